"""The delay server's duty in a replicated group (docs/replication.md, docs/delay.md): what
`qmq.replication.roles.Roles` runs for a delay server in each role.

- **master**: the schedule log, cancels, scheduler and `DelayService` over the store, recovered from
  it (the schedule checkpoint, then the message log after it), the scheduler loading and firing;
  sends and cancels answered once enough replicas hold them.
- **replica**: the same files kept up to date from the copied log (`DelayService.catch_up` after
  each durable chunk: messages into buckets, cancels, dispatch notes into dispatch logs, bucket-done
  notes as done markers), nothing fired; done buckets deleted after the retention, as on a master.
  At promotion they are closed and opened again as a master's: the buckets not done are loaded into
  the wheel from what is filed, less what the dispatch logs say was delivered.
- a cut log (a deposed master) cuts the buckets, dispatch logs and cancels with it (truncation.py).
- a replica whose log the master's retention removed (new, wiped, away too long) copies the
  master's schedule, dispatch logs and cancels instead (snapshot.py), then fetches the log from there.

A delay server without a meta server (or without `--group`) is master alone, as before replication.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from delay_server import metrics, snapshot
from delay_server.cancels import Cancels
from delay_server.clock import Clock
from delay_server.schedule_log import CHECKPOINT_FILE, ScheduleLog
from delay_server.scheduler import DEFAULT_MAX_HELD, RETENTION_POLL_S, Scheduler, release_free_memory
from delay_server.service import DelayService
from delay_server.truncation import cut_back
from qmq.client.aio import AsyncClient
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.store import epochs as ep
from qmq.store.files import read_json
from qmq.store.store import LogStore

log = logging.getLogger("qmq.delay")


def data_dirs(data_dir: Path) -> tuple[Path, Path, Path]:
    """(schedule log, dispatch logs, cancels) of a delay server's data directory; the message log
    (a log store) is the directory itself, so `qmq log verify/dump` read it as they read a broker's."""
    return data_dir / "schedule", data_dir / "dispatch", data_dir / "cancels"


@dataclass
class DelaySettings:
    bucket_minutes: int
    load_ahead_s: float
    retention_s: float
    max_delay_s: float
    max_held: int = DEFAULT_MAX_HELD


class DelayDuty:
    kind = "delay server"
    stats_code = RequestCode.DELAY_STATS

    def __init__(self, settings: DelaySettings, clock: Clock, client: AsyncClient) -> None:
        self.settings = settings
        self.clock = clock
        self.client = client
        self.service: DelayService | None = None  # a master's or a replica's
        self.on_open: Callable[[DelayService], None] = lambda service: None  # the process's metrics
        self._retiring: asyncio.Task[None] | None = None  # a replica's retention
        self.in_office: Callable[[], bool] = lambda: True  # set by Roles: whether a master may fire now

    def open(self, store: LogStore) -> DelayService:
        """Schedule log, cancels, scheduler and service over `store`, recovered. Blocking."""
        s = self.settings
        schedule_dir, dispatch_dir, cancels_dir = data_dirs(Path(store.data_dir))
        schedule = ScheduleLog(schedule_dir, s.bucket_minutes)
        cancels = Cancels(cancels_dir)
        scheduler = Scheduler(
            schedule,
            dispatch_dir,
            cancels,
            self.clock,
            self.client,
            load_ahead_s=s.load_ahead_s,
            retention_s=s.retention_s,
            max_held=s.max_held,
        )
        service = DelayService(store, schedule, cancels, scheduler, self.clock, max_delay_s=s.max_delay_s)
        scheduler.on_dispatched = service.note_dispatched
        scheduler.on_done = service.note_done
        try:
            service.recover()
        except BaseException:
            schedule.close()
            cancels.close()
            raise
        release_free_memory()
        return service

    async def _open(self, store: LogStore) -> DelayService:
        service = await asyncio.to_thread(self.open, store)
        service.start()
        self.service = service
        self.on_open(service)
        return service

    async def _close(self) -> None:
        service, self.service = self.service, None
        if service is not None:
            await service.scheduler.close()
            await service.close()
            service.schedule.close()
            service.cancels.close()

    # ---- Duty -------------------------------------------------------------------------------------

    async def open_master(self, store: LogStore, group: str) -> DelayService:
        service = await self._open(store)
        service.scheduler.in_office = self.in_office
        service.scheduler.start()
        return service

    def set_in_office(self, in_office: Callable[[], bool]) -> None:
        self.in_office = in_office

    async def close_master(self, service: Any) -> None:
        await self._close()

    def set_read_only(self, service: DelayService, read_only: bool) -> None:
        service.read_only = read_only

    def set_acknowledged(self, service: DelayService, acknowledged: Any) -> None:
        service.acknowledged = acknowledged

    async def open_replica(self, store: LogStore) -> None:
        service = await self._open(store)
        self._retiring = asyncio.create_task(self._retire_forever(service), name="qmq-delay-replica-retention")

    async def _retire_forever(self, service: DelayService) -> None:
        while True:
            await asyncio.sleep(RETENTION_POLL_S)  # a period: retention is a matter of time passing
            try:
                await service.retire()
            except Exception:
                log.exception("replica retention failed; trying again in %g s", RETENTION_POLL_S)

    async def replicated(self, end: int) -> None:
        if self.service is None:
            return
        try:
            await self.service.catch_up(end)
        except Exception:  # the next chunk files it again: a bucket is cut back before it is filed
            log.exception("cannot file the replicated log into the schedule log; trying again")

    async def close_replica(self) -> None:
        if self._retiring is not None:
            self._retiring.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retiring
            self._retiring = None
        await self._close()

    async def truncated(self, data_dir: Path, offset: int) -> None:
        await asyncio.to_thread(cut_back, data_dir, offset, self.settings.bucket_minutes)

    def set_role(self, role: str, epoch: int) -> None:
        metrics.REPLICATION.set_role(role, epoch)

    def set_replicas(self, replicas: list[dict[str, Any]]) -> None:
        metrics.REPLICATION.set_replicas(replicas)

    # ---- a replica that retention left behind (snapshot.py) ----------------------------------------

    async def serve_snapshot(
        self, service: DelayService, code: int, body: dict[str, Any], *, epoch: int, epochs: ep.Epochs
    ) -> dict[str, Any]:
        if service.failed is not None:  # the buckets may hold a half-filed batch
            raise RemoteError(ErrorCode.UNAVAILABLE, f"the schedule log could not be written: {service.failed}")
        data_dir = Path(service.store.data_dir)
        if code == RequestCode.REPL_SNAPSHOT:
            listing = snapshot.listing(data_dir, service.filed_upto, epoch, epochs)  # on the loop: see snapshot.py
            log.info(
                "a replica copies this master's schedule, filed up to offset %d (%d files)",
                listing["offset"],
                len(listing["files"]),
            )
            return listing
        return await asyncio.to_thread(snapshot.read_part, data_dir, body)

    async def copy_snapshot(
        self, data_dir: Path, master: str, *, group: str, replica: str, epoch: int, token: str | None
    ) -> snapshot.Snapshot:
        return await snapshot.copy(data_dir, master, group=group, replica=replica, epoch=epoch, token=token)

    def install_snapshot(self, data_dir: Path, copy: snapshot.Snapshot) -> None:
        snapshot.install(data_dir, copy)

    def copy_ahead(self, data_dir: Path, store: LogStore) -> bool:
        """The schedule is a master's copy filed further than this replica's log goes yet."""
        service = self.service
        if service is not None:
            filed = service.filed_upto
        else:
            saved = read_json(data_dir / "schedule" / CHECKPOINT_FILE)
            filed = int(saved["offset"]) if saved else 0
        return filed > store.end_offset

    def mended(self, service: DelayService, messages: list[tuple[str, int]]) -> None:
        pass  # the scheduler reads its buckets, not the message log: nobody waits on a damaged record
