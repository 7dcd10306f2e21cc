"""A server's role in its replicated group (docs/replication.md): master, replica, or pending until
the meta server has said which. Brokers and delay servers share it; what differs (the service a
master runs, what a replica derives from what it copied, metrics) is the server's `Duty`. It owns
the store and swaps what runs over it:

- **master**: the server's service (`Duty.open_master`: recovered from the store when the server
  takes office) and the replication `Followers` (REPL_FETCH, the acknowledgement rule, read-only
  when too few replicas are in sync);
- **replica**: a `Fetcher` copying the master's log (`Duty.replicated` derives from each durable
  chunk); client requests are answered NOT_MASTER with the master's address;
- **pending**: started with a meta server that has not answered yet: NOT_MASTER, nobody named.

A replica whose fetch offset the master's retention removed (new, wiped, or away longer than the
retention) cannot copy the log from there. A server that keeps state beside its log (a delay
server's buckets, a broker's consumption state) copies that state from the master instead (the
duty's optional snapshot methods, REPL_SNAPSHOT), installs it with the store closed, and fetches
the log from where the copy ends.

A server without a meta server is master at once with nothing to wait for, as before replication.

Transitions follow the meta server's answers (`on_meta_reply`), one at a time, newest wish first.
A master steps down when the meta server names another master, or when a replica's fetch carries
a newer epoch. Becoming a replica, a server asks the master where its own last epoch ends there
(REPL_EPOCH_END) and cuts its log back to that (the cut bytes go to quarantine/, the server's own
state is cut too, `Duty.truncated`, and every derived file rebuilt). A master that has not heard
from the meta server for half of `failover_after` fences itself: it acknowledges no send, since a
replica may be taking over; nor for a client that names a newer epoch than its own (NOT_MASTER).
Each change is logged in one line with the epoch and the log offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from qmq.meta.membership import Membership
from qmq.net.server import PeerInfo
from qmq.protocol.codes import RequestCode
from qmq.protocol.connection import Request
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.protocol.fields import body_of
from qmq.replication.crash_points import crash_point
from qmq.replication.fetcher import Fetcher, ask_epoch_end
from qmq.replication.mending import mend_damage, serve_copy
from qmq.store import epochs as ep
from qmq.store.followers import MAX_LAG_S, RETENTION_REFUSED, Followers, NotEnoughReplicas
from qmq.store.replication import truncate_log
from qmq.store.store import LogStore, StoreConfig

log = logging.getLogger("qmq.replication")

TICK_S = 0.1  # how often a master looks at its replicas' lag and its own fencing
DEFAULT_FAILOVER_AFTER_S = 10.0  # until the meta server says otherwise
EPOCH_END_RETRY_S = 0.5
UNREACHABLE_HEARTBEAT_S = 0.25
HANDOFF_TIMEOUT_S = 60.0  # a manual failover waits at most this long for a replica to catch up
HANDOFF_HOLD_S = 10.0  # then sends stay refused this long, while the meta server switches
HANDOFF_POLL_S = 0.02  # a replica that cannot reach its master heartbeats this often


class Role(StrEnum):
    PENDING = "pending"
    MASTER = "master"
    REPLICA = "replica"


class MasterService(Protocol):
    """What a master runs over the store: the server's request handler."""

    async def handle(self, request: Request, peer: PeerInfo) -> dict[str, Any] | None: ...


class Duty(Protocol):
    """What one kind of server (broker, delay server) does in each role; `Roles` calls it.

    Optional, for a server whose state beside the log outlives the log's retention (a delay
    server, a broker): `async serve_snapshot(service, code, body, *, epoch, epochs) -> dict` on a master
    (REPL_SNAPSHOT, REPL_SNAPSHOT_READ), and on a replica `async copy_snapshot(data_dir, master, *,
    group, replica, epoch, token)` (the copy, beside the open store) then `install_snapshot(data_dir,
    copy)` (blocking, the store closed); and `copy_ahead(data_dir, store) -> bool`: its state is a
    copy covering more of the log than the replica holds yet (only as good as the master that made
    it: a replica of another master copies again). And `set_replicated_upto(upto)`, called once, for
    a server whose state is saved in snapshots that a cut may have to go back past (a broker):
    `upto()` is the offset below which no failover can cut this server's log, as far as it knows,
    or None (`Roles.replicated_upto`). And `set_in_office(in_office)`, called once, for a server that
    acts on its own as master (a delay server fires, a broker answers a nack its replicas cannot
    hold): `in_office()` is false while it may no longer (`Roles.in_office`)."""

    kind: str  # "broker", "delay server": the start of each role-change log line
    stats_code: RequestCode  # answered by a server that is not master too

    async def open_master(self, store: LogStore, group: str) -> MasterService:
        """The service of a server taking office, recovered from `store` and started."""
        ...

    async def close_master(self, service: MasterService) -> None: ...

    def set_read_only(self, service: MasterService, read_only: bool) -> None:
        """Sends are to be refused READ_ONLY (or taken again)."""
        ...

    def set_acknowledged(self, service: MasterService, acknowledged: Any) -> None:
        """`await acknowledged(end)` before answering a write that ends at `end`: it returns once
        enough replicas hold it, or raises READ_ONLY / NOT_MASTER."""
        ...

    async def open_replica(self, store: LogStore) -> None:
        """The server is now a replica of `store`'s group (derive from what is copied)."""
        ...

    async def replicated(self, end: int) -> None:
        """A replica's log is durable up to `end` (called after each fetched chunk)."""
        ...

    async def close_replica(self) -> None: ...

    async def truncated(self, data_dir: Path, offset: int) -> bool | None:
        """The (closed) store's log was cut back to `offset`: drop the server's own state beyond it.
        True: that state could not be rebuilt from the log left (retention removed its start), and
        the directory was wiped: the server starts again as a new replica (and copies the master's)."""
        ...

    def set_role(self, role: str, epoch: int) -> None:
        """Metrics of the role."""
        ...

    def set_replicas(self, replicas: list[dict[str, Any]]) -> None:
        """Metrics of the replicas (a master's)."""
        ...

    def mended(self, service: MasterService, messages: list[tuple[str, int]]) -> None:
        """Damaged messages (subject, seq) were mended or given up: readers waiting there look again."""
        ...


@dataclass(frozen=True)
class Wish:
    role: Role
    epoch: int
    master: str | None


class Roles:
    def __init__(
        self,
        store: LogStore,
        config: StoreConfig,
        duty: Duty,
        *,
        group: str,
        address: str,
        token: str | None,
        replicated: bool,
        ack_replicas: int | None,
        max_lag_s: float = MAX_LAG_S,
    ) -> None:
        """`replicated`: a meta server decides the role; otherwise this server is master alone."""
        self.store = store
        self.duty = duty
        self.config = config
        self.data_dir = Path(store.data_dir)
        self.group = group
        self.address = address
        self.token = token
        self.replicated = replicated
        self.ack_replicas = ack_replicas
        self.max_lag_s = max_lag_s
        self.role = Role.PENDING
        self.epoch = 0
        self.master: str | None = None
        self.epochs = self._epochs_within_log()
        store.damage.mendable = replicated  # a damaged record may be copied from another member
        self.service: MasterService | None = None
        self.followers: Followers | None = None
        self.fetcher: Fetcher | None = None
        self.membership: Any = None  # qmq.meta.membership.Membership, set by the process
        self.meta_read_only = False
        self.read_only = False  # what the service was last told
        self._read_only_why = ""  # and why it was told read-only
        self._replica_open = False
        self._started = asyncio.Event()  # a server alone answers once it recovered, not NOT_MASTER
        self.failover_after_s = DEFAULT_FAILOVER_AFTER_S
        self.members = 0  # other servers of the group, per the meta server
        self.changed = asyncio.Event()  # set at every role change (tests and the process wait on it)
        self._wish: Wish | None = None
        self._redo = False  # the fetcher asked to rejoin (truncation) even if the wish is the same
        self._from_snapshot = False  # the master's retention removed this replica's offset: copy its state
        self._copied_by: dict[str, int] = {}  # replicas this master gave a copy of its state: their log start
        self._transition: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._mending: asyncio.Task[None] | None = None
        self._reported_in_sync: set[str] = set()  # as the last heartbeat told the meta server
        self._sent_in_sync: tuple[int, set[str]] | None = None  # (epoch, in sync) of the heartbeat out
        self._meta_in_sync: set[str] = set()  # what the meta server confirmed it heard: they acknowledge
        self._last_unreachable_poke = 0.0
        self._handing_off_until = 0.0  # a manual failover stops sends until then (monotonic)
        if (set_upto := getattr(duty, "set_replicated_upto", None)) is not None:
            set_upto(self.replicated_upto)
        if (set_office := getattr(duty, "set_in_office", None)) is not None:
            set_office(self.in_office)

    # ---- the process's view --------------------------------------------------------------------

    async def start(self) -> None:
        self._ticker = asyncio.create_task(self._tick_forever(), name="qmq-roles")
        if not self.replicated:
            await self._become_master(ep.last_epoch(self.epochs))
        self._started.set()

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        if self._mending is not None:
            self._mending.cancel()
        if self._transition is not None:
            self._transition.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._transition
        await self._stop_master(RemoteError(ErrorCode.UNAVAILABLE, f"the {self.duty.kind} is shutting down"))
        await self._stop_fetcher()
        await self._close_replica()

    def report(self) -> dict[str, Any]:
        """What each heartbeat tells the meta server."""
        body: dict[str, Any] = {
            "role": str(self.role),
            "epoch": self.epoch,
            "log_end": self.store.end_offset,
        }
        if self.role is Role.MASTER and self.followers is not None:
            body["in_sync"] = self.followers.in_sync()
            self._reported_in_sync = set(body["in_sync"])
            self._sent_in_sync = (self.epoch, self._reported_in_sync)
        else:
            self._sent_in_sync = None
        if self.role is Role.REPLICA and self.fetcher is not None and self.fetcher.unreachable:
            body["master_lost"] = True  # with every in-sync replica saying so, the failover comes sooner
        return body

    def on_meta_reply(self, reply: dict[str, Any]) -> None:
        if reply.get("role") is None:  # a meta server without replication: master alone
            self._want(Wish(Role.MASTER, max(self.epoch, ep.last_epoch(self.epochs)), self.address))
            return
        self.failover_after_s = float(reply.get("failover_after_s", DEFAULT_FAILOVER_AFTER_S))
        self.members = int(reply.get("members", 0))
        if self.followers is not None and isinstance(reply.get("peers"), list):
            for address in self.followers.drop_forgotten(set(reply["peers"])):
                log.warning(
                    "%s group %s: replica %s was forgotten by the meta server", self.duty.kind, self.group, address
                )
        epoch, master = int(reply["epoch"]), str(reply["master"])
        sent, self._sent_in_sync = self._sent_in_sync, None
        if sent is not None and master == self.address and epoch == sent[0] == self.epoch:
            self._heard_in_sync(sent[1])
        self._want(Wish(Role.MASTER if master == self.address else Role.REPLICA, epoch, master))

    def _heard_in_sync(self, in_sync: set[str]) -> None:
        """The meta server now holds `in_sync` as this master's in-sync replicas, the only ones it
        would promote: from now on their durable offsets acknowledge sends (docs/replication.md)."""
        if in_sync != self._meta_in_sync:
            self._meta_in_sync = in_sync
            if self.followers is not None:
                self.followers.settle()

    def on_meta_read_only(self, read_only: bool) -> None:
        self.meta_read_only = read_only
        self._update_read_only()

    # ---- requests --------------------------------------------------------------------------------

    async def handle(self, request: Request, peer: PeerInfo) -> dict[str, Any] | None:
        if not self._started.is_set() and not self.replicated:
            await self._started.wait()  # listening already, recovering still: as before replication
        code = request.code
        service, followers = self.service, self.followers
        if code == RequestCode.REPL_READ:  # any member with the bytes durable may mend another's damage
            return await asyncio.to_thread(serve_copy, self.store, self.group, _body(request))
        if code == RequestCode.PING:  # answered whatever the role; counted by the service when there is one
            if service is not None:
                return await service.handle(request, peer)
            return request.body if isinstance(request.body, dict) else {}
        if self.role is not Role.MASTER or service is None:
            if code == self.duty.stats_code:
                return self.stats()
            where = f": the master is {self.master}" if self.master else ""
            raise RemoteError(
                ErrorCode.NOT_MASTER, f"{self.duty.kind} {self.address} is {self.role} in group {self.group}{where}"
            )
        if code == RequestCode.REPL_FETCH and followers is not None:
            body = _body(request)
            if self._copied_by:
                self._crash_point_after_copy(body)
            return await followers.fetch(body)
        if code == RequestCode.REPL_EPOCH_END and followers is not None:
            return await followers.epoch_end(_body(request))
        if code == RequestCode.REPL_HANDOFF and followers is not None:
            return await self._handoff(followers, _body(request))
        if code in (RequestCode.REPL_SNAPSHOT, RequestCode.REPL_SNAPSHOT_READ):
            return await self._serve_snapshot(service, code, _body(request))
        if self.replicated:
            self._check_client_epoch(request.body)
        reply = await service.handle(request, peer)
        if code == self.duty.stats_code and reply is not None:
            reply["replication"] = self.replication_stats()
        return reply

    async def _serve_snapshot(self, service: MasterService, code: int, body: dict[str, Any]) -> dict[str, Any]:
        """REPL_SNAPSHOT / REPL_SNAPSHOT_READ from a replica that retention left behind: the duty's
        state beside the log, of this epoch only (a copy begun under another master is begun again)."""
        serve = getattr(self.duty, "serve_snapshot", None)
        if serve is None:
            raise RemoteError(ErrorCode.BAD_REQUEST, f"a {self.duty.kind}'s replicas copy its log only: no snapshot")
        asked = body.get("epoch")
        if asked != self.epoch:
            raise RemoteError(
                ErrorCode.NOT_MASTER, f"a snapshot of epoch {asked} was asked; this master serves epoch {self.epoch}"
            )
        reply = await serve(service, code, body, epoch=self.epoch, epochs=self.epochs)
        if code == RequestCode.REPL_SNAPSHOT:
            self._copied_by[str(body.get("replica"))] = int(reply["log_start"])
        else:
            crash_point("snapshot-read")
        return reply

    def _crash_point_after_copy(self, body: dict[str, Any]) -> None:
        """Tests (crash_points.py): this master dies at the first fetch of a replica it gave a copy of
        its state, or once that replica holds some of its log."""
        start = self._copied_by.get(str(body.get("replica")))
        if start is not None:
            crash_point("fetch-after-install")
            if int(body.get("offset", 0)) > start:
                crash_point("fetch-after-copy")

    def _check_client_epoch(self, body: Any) -> None:
        """A client that names a newer epoch than this master's learned of a failover this server
        has not heard of yet: this server may be deposed, so it acknowledges nothing for that client
        (NOT_MASTER, the client asks for the route again) and asks the meta server at once. An older
        epoch is only a stale route, and is served."""
        claimed = body.get("epoch") if isinstance(body, dict) else None
        if type(claimed) is not int or claimed <= self.epoch:
            return
        if self.membership is not None:
            self.membership.poke()
        raise RemoteError(
            ErrorCode.NOT_MASTER,
            f"{self.duty.kind} {self.address} serves epoch {self.epoch} of group {self.group}, "
            f"the client knows epoch {claimed}: ask the meta server for the group's master",
        )

    def stats(self) -> dict[str, Any]:
        """The stats of a server that is not master: who it is and how far its log goes."""
        return {
            "group": self.group,
            "read_only": True,
            "subjects": [],
            "groups": [],
            "replication": self.replication_stats(),
        }

    def replication_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "role": str(self.role),
            "epoch": self.epoch,
            "master": self.master,
            "log_end": self.store.end_offset,
            "durable": self.store.durable_offset,
            # damaged message-log regions awaiting a mend from a member, and those mended or lost since start
            "damage": {
                "awaiting": self.store.damage.pending,
                "mended": self.store.damage.mended,
                "lost": self.store.damage.lost,
            },
        }
        if self.followers is not None and self.service is not None:
            self._update_read_only()  # what the stats say is what a send meets now
            stats["ack_replicas"] = self.followers.ack_replicas
            stats["replicas"] = self.followers.stats()
            stats["writable"] = not self.read_only
            stats["read_only_why"] = self._read_only_why
        if self.membership is not None:
            stats["meta_reply_age_s"] = round(time.monotonic() - self.membership.last_reply_at, 3)
        if self.fetcher is not None:
            stats["master_end"] = self.fetcher.master_end
            stats["lag_bytes"] = max(0, self.fetcher.master_end - self.store.end_offset)
        return stats

    # ---- transitions -----------------------------------------------------------------------------

    def _want(self, wish: Wish) -> None:
        if wish.epoch < self.epoch:
            return  # an answer from before a change this server already saw
        self._wish = wish
        if self._transition is None or self._transition.done():
            self._transition = asyncio.create_task(self._apply(), name="qmq-role-change")

    async def _apply(self) -> None:
        while self._wish is not None:
            wish = self._wish
            current = Wish(self.role, self.epoch, self.master)
            if wish == current and not self._redo:
                return
            self._redo = False
            try:
                if wish.role is Role.MASTER:
                    await self._become_master(wish.epoch)
                else:
                    await self._become_replica(wish.epoch, wish.master or "")
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("role change to %s (epoch %d) failed; trying again", wish.role, wish.epoch)
                await asyncio.sleep(EPOCH_END_RETRY_S)
            if self._wish == wish and Wish(self.role, self.epoch, self.master) == wish and not self._redo:
                return

    async def _become_master(self, epoch: int) -> None:
        await self._stop_fetcher()
        await self._close_replica()
        end = self.store.end_offset
        await self.store.flushed(end)
        if epoch > ep.last_epoch(self.epochs):
            self.epochs = ep.with_epoch(self.epochs, epoch, end)
            await asyncio.to_thread(ep.save, self.data_dir, self.epochs)
        self._handing_off_until = 0.0  # a new term: an earlier term's handoff holds no send back
        if self.service is None:
            service = await self.duty.open_master(self.store, self.group)
            self.duty.set_acknowledged(service, self._acknowledged)
            self.read_only = False
            self.service = service
        if self.followers is not None:
            self.followers.close(RemoteError(ErrorCode.NOT_MASTER, "a new epoch began"))
        self.followers = Followers(
            self.store,
            epoch=epoch,
            epochs=self.epochs,
            ack_replicas=self.ack_replicas if self.replicated else 0,
            max_lag_s=self.max_lag_s,
            on_newer_epoch=self._newer_epoch_seen,
            fenced=self._fenced,
            known_replicas=lambda: self.members,
            counted=(lambda: self._meta_in_sync) if self.replicated else None,
        )
        self._meta_in_sync = set()  # the meta server cleared the list when it made this epoch
        self.role, self.epoch, self.master = Role.MASTER, epoch, self.address
        self._update_read_only()
        self._changed()
        log.log(
            logging.WARNING if self.replicated else logging.INFO,  # a lone server's start is no event
            "%s group %s: %s is MASTER, epoch %d (log %d..%d)",
            self.duty.kind,
            self.group,
            self.address,
            epoch,
            self.store.start_offset,
            end,
        )

    async def _become_replica(self, epoch: int, master: str) -> None:
        was_master = self.role is Role.MASTER
        await self._stop_master(RemoteError(ErrorCode.NOT_MASTER, f"deposed: the master is {master} (epoch {epoch})"))
        await self._stop_fetcher()
        self.role, self.epoch, self.master = Role.PENDING, epoch, master
        mine = ep.last_epoch(self.epochs)
        if not self._from_snapshot and epoch > mine and await self._copy_ahead():
            # A copy of the previous master's state covering log this replica has not fetched: the new
            # master may never have had that log (it was durable on the old master alone), so the copy
            # may hold what the group lost (acks, groups) and skip the new master's journal there.
            log.warning(
                "%s group %s: the state copied from the previous master covers log beyond %d that the new "
                "master %s may not hold: copying the new master's",
                self.duty.kind,
                self.group,
                self.store.end_offset,
                master,
            )
            self._from_snapshot = True
        if self._from_snapshot:
            await self._close_replica()
            await self._start_over_from_snapshot(master, epoch)
        elif mine > 0 and self.store.end_offset > 0:
            end_offset = await ask_epoch_end(master, mine, token=self.token, client_id=f"replica-{self.address}")
            if end_offset < self.store.end_offset:
                await self._close_replica()
                await self._truncate(end_offset)
        if not self._replica_open:
            await self.duty.open_replica(self.store)
            self._replica_open = True
        self.fetcher = Fetcher(
            self.store,
            group=self.group,
            address=self.address,
            master=master,
            epoch=epoch,
            epochs=self.epochs,
            save_epochs=self._save_epochs,
            token=self.token,
            on_trouble=self._fetch_trouble,
            on_unreachable=self._master_unreachable,
            on_durable=self.duty.replicated,
        )
        self.fetcher.start()
        self.role = Role.REPLICA
        self._changed()
        log.warning(
            "%s group %s: %s is REPLICA of %s, epoch %d (log end %d)%s",
            self.duty.kind,
            self.group,
            self.address,
            master,
            epoch,
            self.store.end_offset,
            ", stepped down" if was_master else "",
        )

    async def _copy_ahead(self) -> bool:
        check = getattr(self.duty, "copy_ahead", None)
        return bool(check is not None and await asyncio.to_thread(check, self.data_dir, self.store))

    async def _truncate(self, offset: int) -> None:
        """Cut the log back to `offset` (what the new master does not have) and reopen the store.
        A server whose own state covered what was cut and cannot be rebuilt from the log left wipes
        its directory (`Duty.truncated`): it starts again as a new replica."""
        before = self.store.end_offset
        await asyncio.to_thread(self.store.close)
        cut = await asyncio.to_thread(truncate_log, self.data_dir, offset)
        if await self.duty.truncated(self.data_dir, offset):  # the server's own state may cover what was cut
            self.epochs = ep.load(self.data_dir)  # none: wiped
        else:
            self.epochs = ep.truncated(self.epochs, offset)
            await asyncio.to_thread(ep.save, self.data_dir, self.epochs)
        self.store = await asyncio.to_thread(LogStore, self.data_dir, self.config)
        self.store.damage.mendable = self.replicated
        log.warning(
            "%s group %s: log cut back from %d to %d (%d bytes in quarantine/) to match the master",
            self.duty.kind,
            self.group,
            before,
            offset,
            cut,
        )

    async def _start_over_from_snapshot(self, master: str, epoch: int) -> None:
        """Copy the master's state beside its log (the store still open, so a failed copy changes
        nothing), install it with the store closed, and reopen the store: its log now begins, empty,
        where the copy's begins, and the fetcher goes on from there."""
        before = self.store.end_offset
        copy = await self.duty.copy_snapshot(  # type: ignore[attr-defined]
            self.data_dir, master, group=self.group, replica=self.address, epoch=epoch, token=self.token
        )
        await asyncio.to_thread(self.store.close)
        try:
            await asyncio.to_thread(self.duty.install_snapshot, self.data_dir, copy)  # type: ignore[attr-defined]
        finally:
            self.store = await asyncio.to_thread(LogStore, self.data_dir, self.config)
            self.store.damage.mendable = self.replicated
            self.epochs = ep.load(self.data_dir)
        self._from_snapshot = False
        log.warning(
            "%s group %s: %s copied the state of master %s (its log from %d was removed by retention); "
            "fetching its log from %d",
            self.duty.kind,
            self.group,
            self.address,
            master,
            before,
            self.store.end_offset,
        )

    async def _stop_master(self, error: RemoteError) -> None:
        if self.followers is not None:
            self.followers.close(error)
            self.followers = None
        if self.service is not None:
            service, self.service = self.service, None
            await self.duty.close_master(service)

    async def _stop_fetcher(self) -> None:
        if self.fetcher is not None:
            fetcher, self.fetcher = self.fetcher, None
            await fetcher.stop()

    async def _close_replica(self) -> None:
        if self._replica_open:
            self._replica_open = False
            await self.duty.close_replica()

    def _epochs_within_log(self) -> ep.Epochs:
        """The epochs file, cut back to the recovered log end (Kafka cuts its epoch cache there too).
        A line is saved once its records are written, maybe before they are durable: after a machine
        crash it can begin past the log end, and an epoch taken later would then be filed before it."""
        saved = ep.load(self.data_dir)
        epochs = ep.truncated(saved, self.store.end_offset)
        if epochs != saved:
            log.warning(
                "%s group %s: epochs %s began past the recovered log end %d: removed from the epochs file",
                self.duty.kind,
                self.group,
                ", ".join(str(e) for e, _ in saved[len(epochs) :]),
                self.store.end_offset,
            )
            ep.save(self.data_dir, epochs)
        return epochs

    def _save_epochs(self, epochs: ep.Epochs) -> None:
        ep.save(self.data_dir, epochs)
        self.epochs = epochs

    def _changed(self) -> None:
        self.duty.set_role(str(self.role), self.epoch)
        self.changed.set()
        self.changed = asyncio.Event()
        if self.membership is not None:
            self.membership.poke()

    # ---- signals from below ------------------------------------------------------------------------

    def _newer_epoch_seen(self, epoch: int) -> None:
        """A replica fetched with a newer epoch: another server is master. Stop taking sends now and
        ask the meta server who."""
        if self.role is Role.MASTER and epoch > self.epoch:
            log.warning(
                "%s group %s: a fetch carries epoch %d > %d: stepping down",
                self.duty.kind,
                self.group,
                epoch,
                self.epoch,
            )
            self.role = Role.PENDING
            if self.followers is not None:
                self.followers.close(RemoteError(ErrorCode.NOT_MASTER, f"epoch {epoch} began elsewhere"))
            if self.membership is not None:
                self.membership.poke()

    def _fetch_trouble(self, exc: RemoteError) -> None:
        retention = exc.code == ErrorCode.BAD_REQUEST and RETENTION_REFUSED in exc.message
        if retention and hasattr(self.duty, "copy_snapshot") and not self._from_snapshot:
            self._from_snapshot = True
            log.warning(
                "%s group %s: the master no longer holds this replica's log from %d: copying its state instead",
                self.duty.kind,
                self.group,
                self.store.end_offset,
            )
        if exc.code == ErrorCode.BAD_REQUEST and ("truncate" in exc.message or self._from_snapshot):
            self._redo = True
            if self._wish is not None:
                self._want(self._wish)
        if self.membership is not None:
            self.membership.poke()

    def _master_unreachable(self) -> None:
        """Heartbeat at most every UNREACHABLE_HEARTBEAT_S while the master cannot be reached, so a
        promotion is learnt within that, not at the next regular heartbeat."""
        now = time.monotonic()
        if self.membership is not None and now - self._last_unreachable_poke >= UNREACHABLE_HEARTBEAT_S:
            self._last_unreachable_poke = now
            self.membership.poke()

    def fence_at(self) -> float | None:
        """The monotonic time at which this server, as master, fences itself unless a meta server
        answers first: half of `failover_after` after the last answer, so that it stops taking sends
        well before a meta server could promote a replica."""
        if self.membership is None:
            return None
        return self.membership.last_reply_at + self.failover_after_s / 2

    def _fenced(self) -> bool:
        fence_at = self.fence_at()
        return fence_at is not None and time.monotonic() > fence_at

    def in_office(self) -> bool:
        """Whether this server may act for its group now, beyond answering: master, not fenced (a
        replica may have been promoted since) and not handing off (its replica is about to be)."""
        return self.role is Role.MASTER and not self._fenced() and time.monotonic() >= self._handing_off_until

    def replicated_upto(self) -> int | None:
        """The offset below which no failover can cut this server's log, as far as it knows: as
        master, what every replica it heard from holds durable (`Followers.replicated_upto`); as
        replica, what its master last said of the same (as Kafka's followers learn the high
        watermark). None when it does not know, or alone."""
        if not self.replicated:
            return None
        if self.role is Role.MASTER and self.followers is not None:
            return self.followers.replicated_upto()
        if self.role is Role.REPLICA and self.fetcher is not None:
            return self.fetcher.master_replicated_upto
        return None

    async def _acknowledged(self, end: int) -> None:
        followers = self.followers
        if followers is None or self.role is not Role.MASTER:
            raise RemoteError(
                ErrorCode.NOT_MASTER, f"{self.duty.kind} {self.address} is no longer master of {self.group}"
            )
        try:
            await followers.acknowledged(end)
        except NotEnoughReplicas as exc:
            raise RemoteError(
                ErrorCode.READ_ONLY, f"{self.duty.kind} group {self.group} cannot replicate now: {exc}"
            ) from None

    async def _handoff(self, followers: Followers, body: dict[str, Any]) -> dict[str, Any]:
        """REPL_HANDOFF (`qmq admin failover`): stop taking sends, wait until a replica (`to`, or the
        in-sync one furthest along) holds the whole log, and name it. Sends stay refused for
        HANDOFF_HOLD_S, time for the meta server to switch (this master then steps down)."""
        to = body.get("to")
        if to is not None and not isinstance(to, str):
            raise RemoteError(ErrorCode.BAD_REQUEST, "field 'to' must be a replica's address")
        timeout_s = min(float(body.get("timeout_ms", HANDOFF_TIMEOUT_S * 1000)), HANDOFF_TIMEOUT_S * 1000) / 1000
        self._handing_off_until = time.monotonic() + timeout_s + HANDOFF_HOLD_S
        self._update_read_only()
        end = self.store.end_offset  # sends are refused from here on: this is the log to hand over
        deadline = time.monotonic() + timeout_s
        while True:
            in_sync = set(followers.in_sync())
            ready = [
                r
                for r in followers.replicas.values()
                if r.offset >= end and (r.address == to if to else r.address in in_sync)
            ]
            if ready:
                chosen = max(ready, key=lambda r: r.offset).address
                log.warning("%s group %s: handing off to %s at log end %d", self.duty.kind, self.group, chosen, end)
                self._handing_off_until = time.monotonic() + HANDOFF_HOLD_S  # while the meta server switches
                return {"replica": chosen, "end": end, "epoch": self.epoch}
            if time.monotonic() >= deadline:
                self._handing_off_until = 0.0
                self._update_read_only()
                who = to or "an in-sync replica"
                raise RemoteError(ErrorCode.TIMEOUT, f"{who} did not catch up with log end {end} in {timeout_s:g} s")
            try:
                await asyncio.sleep(HANDOFF_POLL_S)  # replicas fetch every few ms while sends are stopped
            except asyncio.CancelledError:  # the request went away (its connection closed): sends again
                self._handing_off_until = 0.0
                self._update_read_only()
                raise

    def _update_read_only(self) -> None:
        if self.service is None:
            return
        lagging = self.followers is not None and not self.followers.writable
        handing_off = time.monotonic() < self._handing_off_until
        read_only = self.meta_read_only or lagging or handing_off
        why = (
            "set by the meta server"
            if self.meta_read_only
            else self.followers.why_not_writable()
            if lagging and self.followers is not None
            else "handing off to a replica"
            if handing_off
            else ""
        )
        if read_only != self.read_only:
            log.warning(
                "%s group %s is now %s%s",
                self.duty.kind,
                self.group,
                "read-only" if read_only else "writable",
                f" ({why})" if why else "",
            )
        elif read_only and _kind_of(why) != _kind_of(self._read_only_why):  # still refusing sends, for another reason
            log.warning("%s group %s is still read-only, now because %s", self.duty.kind, self.group, why)
        self.read_only, self._read_only_why = read_only, why
        self.duty.set_read_only(self.service, read_only)

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)  # a period: lag is a matter of time passing
            try:
                if self.store.damage.pending and (self._mending is None or self._mending.done()):
                    self._mending = asyncio.create_task(self._mend(), name="qmq-mending")
                if self.followers is not None:
                    self.followers.check()
                    self._update_read_only()
                    self.duty.set_replicas(self.followers.stats())
                    # The meta server promotes only replicas it heard were in sync: tell it at once.
                    if self.membership is not None and set(self.followers.in_sync()) != self._reported_in_sync:
                        self.membership.poke()
            except Exception:
                log.exception("replication check failed")

    async def _mend(self) -> None:
        """Mend damaged records of the log from the members that hold them (mending.py): a master
        asks its replicas that have them durable, a replica its master."""
        if self.role is Role.MASTER and self.followers is not None:
            peers = [r.address for r in self.followers.replicas.values() if r.address != self.address]
            alone = not peers and self.members == 0
        elif self.role is Role.REPLICA and self.master:
            peers, alone = [self.master], False
        else:
            peers, alone = [], not self.replicated
        settled = await mend_damage(
            self.store, peers, alone=alone, group=self.group, token=self.token, client_id=f"mend-{self.address}"
        )
        if settled and self.service is not None:
            self.duty.mended(self.service, settled)


def _body(request: Request) -> dict[str, Any]:
    return body_of(request.body)


def join(roles: Roles, meta: str, *, kind: str, external_address: str | None, replicated: bool = True) -> Membership:
    """Register with the meta server and heartbeat; a `replicated` server reports its role with each
    heartbeat and follows the answers (the group's master and epoch)."""
    membership = Membership(
        meta,
        kind=kind,
        group=roles.group if replicated or kind == "broker" else None,
        address=roles.address,
        external_address=external_address,
        token=roles.token,
        on_read_only=roles.on_meta_read_only,
        report=roles.report if replicated else None,
        on_reply=roles.on_meta_reply if replicated else None,
        answer_by=roles.fence_at if replicated else None,
    )
    roles.membership = membership if replicated else None
    membership.start()
    return membership


def _kind_of(why: str) -> str:
    """A read-only reason without its counts, so that a count changing is not logged as a new reason."""
    return re.sub(r"\d+", "#", why)
