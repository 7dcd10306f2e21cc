"""The broker's pulls waiting for messages (qmq/broker/core.py), in process on a real store: a subject
whose pulls all ended, woken or timed out, leaves no entry behind (a broker of many short-lived
subjects would otherwise grow one per subject for ever), and a pull that times out leaves the others
of its subject waiting."""

from __future__ import annotations

import asyncio

from qmq.broker.core import BrokerCore
from qmq.broker.state import BrokerState
from qmq.store.store import LogStore
from tests.support.stores import SMALL

SHORT_WAIT_S = 0.01
LONG_WAIT_S = 30.0


def test_subjects_whose_pulls_ended_leave_no_entry(tmp_path) -> None:
    async def scenario(core: BrokerCore) -> None:
        assert await core.wait_for_messages("quiet", SHORT_WAIT_S) is False  # timed out
        assert core.waiting_pulls() == {}
        assert "quiet" not in core._waiters

        patient = asyncio.create_task(core.wait_for_messages("busy", LONG_WAIT_S))
        hasty = asyncio.create_task(core.wait_for_messages("busy", SHORT_WAIT_S))
        assert await hasty is False
        assert core.waiting_pulls() == {"busy": 1}  # the other pull of the subject still waits
        core.wake(["busy"])
        assert await patient is True
        assert core._waiters == {}

    with LogStore(tmp_path, SMALL) as store:
        asyncio.run(scenario(BrokerCore(store, BrokerState())))
