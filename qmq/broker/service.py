"""The broker's request handler (docs/broker.md): its requests, over a `LogStore` and the consumption
state recovered from the last snapshot and the journal, with the loops that run beside them.

The parts, one concern each: `core.py` (the store, the state, the journal, waiting pulls),
`recovery.py` (the state at start), `sending.py` (BROKER_SEND), `consuming.py` (pull, ack, nack,
heartbeat), `admin.py` (reset, groups, dead letters, stats, consumers), `lookup.py` (a message and its
life), `background.py` (retries, silent consumers, snapshots). The request path common to every
server (dispatch, field errors, UNAVAILABLE on a store failure, request metrics) is `qmq.net.service`.

Promises: a send is acknowledged only once durable (sync mode); a pull never hands out a message to
two consumers of a group while both are alive; nothing pulled is lost by a crash (it is resent until
acked); a failing message goes to its group's retry subject after the delay asked for, or to the
dead-letter subject, without holding up the rest of its group.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any

from qmq.broker import metrics
from qmq.broker.admin import Administration
from qmq.broker.ahead import AHEAD_WINDOW_S
from qmq.broker.background import BackgroundWork
from qmq.broker.consuming import Consuming
from qmq.broker.core import DEFAULT_CONSUMER_TIMEOUT_S, DEFAULT_MAX_ATTEMPTS, BrokerCore, Clock
from qmq.broker.lookup import lookup
from qmq.broker.ordered import Ordering
from qmq.broker.queue_lease import ORDERED_LEASE_S
from qmq.broker.recovery import recover
from qmq.broker.sending import Sending
from qmq.broker.state import BrokerState
from qmq.net.service import Service
from qmq.protocol.codes import RequestCode
from qmq.protocol.limits import DEFAULT_LIMITS, Limits, validate_consumer
from qmq.store.flush import FlushFailed
from qmq.store.store import LogStore, StoreError

STATE_DIR = "consumers"  # in the data directory: the consumption snapshot


class BrokerService(Service):
    name = "broker"
    log = logging.getLogger("qmq.broker")
    storage_errors = (StoreError, FlushFailed)

    def __init__(
        self,
        store: LogStore,
        *,
        state_dir: Path | None = None,
        consumer_timeout_s: float = DEFAULT_CONSUMER_TIMEOUT_S,
        ahead_window_s: float = AHEAD_WINDOW_S,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        limits: Limits = DEFAULT_LIMITS,
        clock: Clock = time.time,
        ordered_lease_s: float = ORDERED_LEASE_S,
    ) -> None:
        """Recovers the consumption state (blocking)."""
        super().__init__(metrics.REQUESTS)
        state_dir = state_dir or store.data_dir / STATE_DIR
        state = recover(store, state_dir, clock())
        state.leases.set_lease_s(ordered_lease_s, clock())
        self.core = BrokerCore(
            store, state, consumer_timeout_s=consumer_timeout_s, max_attempts=max_attempts, limits=limits, clock=clock
        )
        self.background = BackgroundWork(self.core, state_dir)
        self.sending, self.consuming = Sending(self.core), Consuming(self.core, ahead_window_s)
        self.admin = admin = Administration(self.core)
        self.handlers |= {
            RequestCode.BROKER_SEND: self.sending.send,
            RequestCode.BROKER_PULL: self.consuming.pull,
            RequestCode.BROKER_ACK: self.consuming.ack,
            RequestCode.BROKER_NACK: self.consuming.nack,
            RequestCode.BROKER_HEARTBEAT: self._heartbeat,
            RequestCode.BROKER_LEAVE: self.consuming.leave,
            RequestCode.BROKER_RESET: admin.reset,
            RequestCode.BROKER_DEAD_LIST: admin.dead_list,
            RequestCode.BROKER_DEAD_REDRIVE: admin.redrive,
            RequestCode.BROKER_DEAD_PURGE: admin.purge,
            RequestCode.BROKER_STATS: admin.stats_request,
            RequestCode.BROKER_LOOKUP: functools.partial(lookup, self.core),
            RequestCode.BROKER_GROUP_CREATE: admin.group_create,
            RequestCode.BROKER_GROUP_DELETE: admin.group_delete,
            RequestCode.BROKER_CONSUMERS: admin.consumers,
            RequestCode.BROKER_QUEUE_LOCK: Ordering(self.core).lock,
        }

    async def _heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        """BROKER_HEARTBEAT, and the worker's report it may carry (for BROKER_CONSUMERS)."""
        reply = await self.consuming.heartbeat(body)
        if body.get("worker") is not None:
            consumers = {item[2] for item in body["consumers"]}
            if body.get("consumer") is not None:
                consumers.add(validate_consumer(body["consumer"]))
            self.admin.note_report(sorted(consumers), body["worker"])
        return reply

    @property
    def state(self) -> BrokerState:
        return self.core.state

    def start(self) -> None:
        """Start the background loops on the running event loop."""
        self.background.start()
        self.admin.start()

    async def stop_background(self) -> None:
        await self.background.stop()
        await self.admin.stop()

    async def close(self) -> None:
        """Stop the background loops, let sends cut short settle, and write a last snapshot."""
        await self.stop_background()
        await self.sending.group_commit.close()
        await self.background.take_snapshot()

    def stats(self) -> dict[str, Any]:
        return self.admin.stats()
