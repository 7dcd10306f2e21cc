"""The broker's duty in a replicated group (docs/replication.md): what `qmq.replication.roles.Roles`
runs for a broker in each role.

- **master**: the `BrokerService` (its consumption state recovered from the store when the broker
  takes office: the last snapshot, then the journal after it), with sends held until enough
  replicas have them.
- **replica**: the store derives consume logs and index from what it copies; the consumption state
  follows the copied journal and is snapshotted as on a master (replica_state.py), so a promotion
  recovers from a recent snapshot, whatever retention removed meanwhile.
- a cut log drops the consumption snapshots that cover what was cut and goes on from the newest
  one left (the last few are kept, snapshot.py); with none left, if the log left cannot rebuild the
  state either (retention removed its start), the directory is wiped: the broker starts again as a
  new replica and copies the master's state.
- a replica whose log the master's retention removed (new, wiped, away too long) copies the
  master's consumption state instead (state_copy.py), then fetches the retained log from its start.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qmq.broker import metrics, recovery, snapshot, state_copy
from qmq.broker.replica_state import ReplicaState
from qmq.broker.service import STATE_DIR, BrokerService
from qmq.protocol.codes import RequestCode
from qmq.protocol.limits import ACTION_SUBJECT
from qmq.replication import install as install_marker
from qmq.store import epochs as ep
from qmq.store.store import LogStore, StoreConfig

log = logging.getLogger("qmq.broker")


class BrokerDuty:
    kind = "broker"
    stats_code = RequestCode.BROKER_STATS

    def __init__(self, service_options: dict[str, Any], store_config: StoreConfig | None = None) -> None:
        self.service_options = service_options
        self.store_config = store_config or StoreConfig()
        self.replica: ReplicaState | None = None
        self.copies = state_copy.Copies()  # a master's copies of its state for replicas left behind
        self.replicated_upto: Callable[[], int | None] = lambda: None  # Roles.replicated_upto, once set
        self.in_office: Callable[[], bool] = lambda: True  # Roles.in_office, once set

    async def open_master(self, store: LogStore, group: str) -> BrokerService:
        service = await asyncio.to_thread(BrokerService, store, **self.service_options)
        service.core.group_name = group
        service.core.replicated_upto = self.replicated_upto
        service.core.in_office = self.in_office
        service.start()
        return service

    async def close_master(self, service: BrokerService) -> None:
        await service.close()

    def set_read_only(self, service: BrokerService, read_only: bool) -> None:
        service.core.read_only = read_only

    def set_acknowledged(self, service: BrokerService, acknowledged: Any) -> None:
        service.core.replicated = acknowledged

    def set_replicated_upto(self, upto: Callable[[], int | None]) -> None:
        self.replicated_upto = upto

    def set_in_office(self, in_office: Callable[[], bool]) -> None:
        self.in_office = in_office

    async def open_replica(self, store: LogStore) -> None:
        replica = ReplicaState(store, store.data_dir / STATE_DIR, replicated_upto=self.replicated_upto)
        await replica.open()
        self.replica = replica

    async def replicated(self, end: int) -> None:
        if self.replica is not None:
            self.replica.replicated(end)

    async def close_replica(self) -> None:
        replica, self.replica = self.replica, None
        if replica is not None:
            await replica.close()

    async def truncated(self, data_dir: Path, offset: int) -> bool:
        return await asyncio.to_thread(self._cut_state, data_dir, offset)

    def _cut_state(self, data_dir: Path, offset: int) -> bool:
        """After the log was cut at `offset`: the consumption snapshots covering a journal record that
        was cut go, and the state goes on from the newest one left whose journal after it is still in
        the log (snapshot.keep_within: the last few are kept for this). Without one, it is replayed
        from the journal if the log still begins at 0. If it does not (retention, or a copy of a
        master's state), the journal left cannot rebuild it: the directory is wiped (True), so the
        broker starts again as a new replica, which copies the master's state. Blocking."""
        state_dir = data_dir / STATE_DIR
        newest = _newest_seq(state_dir)
        with LogStore(data_dir, self.store_config) as store:  # the derived files rebuilt for the cut log
            journal_end, log_start = store.next_seq(ACTION_SUBJECT), store.start_offset
            kept = snapshot.keep_within(state_dir, journal_end, lambda seq: recovery.journal_retained(store, seq))
        if kept is not None:
            if newest is not None and kept.journal_seq < newest:
                log.warning(
                    "the consumption snapshot covers journal records cut at %d: going on from the one before it "
                    "of journal sequence %d (log end %s), the journal after it replayed from the log (%d..)",
                    offset,
                    kept.journal_seq,
                    kept.log_end,
                    log_start,
                )
            return False  # it covers only what is left
        shutil.rmtree(state_dir, ignore_errors=True)
        if log_start == 0:
            return False  # the whole journal is left: the state is replayed from it
        log.warning(
            "the consumption state covers journal records cut at %d and the log left begins at %d: the data "
            "directory is wiped, to copy the master's state again",
            offset,
            log_start,
        )
        install_marker.wipe(data_dir, state_copy.STATE_DIRS)
        return True

    def copy_ahead(self, data_dir: Path, store: LogStore) -> bool:
        """The consumption state is a master's copy covering journal records not fetched yet."""
        replica = self.replica
        if replica is not None and replica.state is not None:
            seq = replica.state.journal_seq
        else:
            try:
                saved = snapshot.load(data_dir / STATE_DIR)
            except snapshot.SnapshotError:
                saved = None
            seq = int(saved.get("journal_seq", 0)) if saved else 0
        return seq > store.next_seq(ACTION_SUBJECT)

    def set_role(self, role: str, epoch: int) -> None:
        metrics.REPLICATION.set_role(role, epoch)

    def set_replicas(self, replicas: list[dict[str, Any]]) -> None:
        metrics.REPLICATION.set_replicas(replicas)

    def mended(self, service: BrokerService, messages: list[tuple[str, int]]) -> None:
        service.core.wake({subject for subject, _seq in messages})

    # ---- a replica that retention left behind (state_copy.py) --------------------------------------

    async def serve_snapshot(
        self, service: BrokerService, code: int, body: dict[str, Any], *, epoch: int, epochs: ep.Epochs
    ) -> dict[str, Any]:
        if code == RequestCode.REPL_SNAPSHOT_READ:
            return self.copies.read(body)
        state_copy.refuse(body.get("kind"))
        core = service.core
        store = core.store
        data = core.state.to_snapshot()  # on the loop, where the state changes: whole, at journal_seq
        log_start, offset = store.start_offset, store.end_offset
        await store.flushed(offset)  # the journal it covers is durable (as for the broker's own snapshots)
        floors = await asyncio.to_thread(state_copy.sequence_floors, store, log_start)
        blob = await asyncio.to_thread(state_copy.pack_copy, data, log_start=log_start, offset=offset, floors=floors)
        name = self.copies.add(epoch, blob)
        log.info(
            "a replica copies this master's consumption state (journal sequence %d, %d bytes); its log from %d",
            data["journal_seq"],
            len(blob),
            log_start,
        )
        return {
            "kind": state_copy.KIND,
            "epoch": epoch,
            "offset": offset,
            "log_start": log_start,
            "epochs": [list(e) for e in epochs],
            "name": name,
            "size": len(blob),
        }

    async def copy_snapshot(
        self, data_dir: Path, master: str, *, group: str, replica: str, epoch: int, token: str | None
    ) -> state_copy.StateCopy:
        return await state_copy.copy(master, group=group, replica=replica, epoch=epoch, token=token)

    def install_snapshot(self, data_dir: Path, copy: state_copy.StateCopy) -> None:
        state_copy.install(data_dir, self.store_config, copy)


def _newest_seq(state_dir: Path) -> int | None:
    """The journal sequence of the newest consumption snapshot that checks out, if any."""
    found, _problems = snapshot.generations(state_dir)
    return found[0].journal_seq if found else None
