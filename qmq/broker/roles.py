"""The broker's duty in a replicated group (docs/replication.md): what `qmq.replication.roles.Roles`
runs for a broker in each role. As master, the `BrokerService` (its consumption state recovered from
the store when the broker takes office), with sends held until enough replicas have them; as a
replica, nothing beyond the fetcher: the store derives consume logs and index from what it copies,
and the consumption state is recovered from the journal at promotion. A cut log drops the
consumption snapshot, which may cover what was cut.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

from qmq.broker import metrics
from qmq.broker.service import STATE_DIR, BrokerService
from qmq.protocol.codes import RequestCode
from qmq.store.store import LogStore


class BrokerDuty:
    kind = "broker"
    stats_code = RequestCode.BROKER_STATS

    def __init__(self, service_options: dict[str, Any]) -> None:
        self.service_options = service_options

    async def open_master(self, store: LogStore, group: str) -> BrokerService:
        service = await asyncio.to_thread(BrokerService, store, **self.service_options)
        service.core.group_name = group
        service.start()
        return service

    async def close_master(self, service: BrokerService) -> None:
        await service.close()

    def set_read_only(self, service: BrokerService, read_only: bool) -> None:
        service.core.read_only = read_only

    def set_acknowledged(self, service: BrokerService, acknowledged: Any) -> None:
        service.core.replicated = acknowledged

    async def open_replica(self, store: LogStore) -> None:
        pass

    async def replicated(self, end: int) -> None:
        pass

    async def close_replica(self) -> None:
        pass

    async def truncated(self, data_dir: Path, offset: int) -> None:
        shutil.rmtree(data_dir / STATE_DIR, ignore_errors=True)

    def set_role(self, role: str, epoch: int) -> None:
        metrics.REPLICATION.set_role(role, epoch)

    def set_replicas(self, replicas: list[dict[str, Any]]) -> None:
        metrics.REPLICATION.set_replicas(replicas)

    def mended(self, service: BrokerService, messages: list[tuple[str, int]]) -> None:
        service.core.wake({subject for subject, _seq in messages})
