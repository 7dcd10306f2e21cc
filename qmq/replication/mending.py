"""Mending a damaged record from another member of the group (issue 19; docs/replication.md, "A
damaged record"), shared by brokers and delay servers.

Every member of a group holds the same log bytes at the same offsets up to its durable end, so a
record that fails its CRC on one member can be copied from another: the damaged member asks a member
that holds the region durable (a master asks its replicas, a replica its master) with REPL_READ,
and `LogStore.mend` checks every record's CRC and that the copy fills the region exactly, writes it
in place and fsyncs. Readers hold back at the region's messages meanwhile (store/damage.py). When no
member gives a good copy within `MEND_GIVE_UP_S`, or the server has no other member, the region is
lost and the broker dead-letters its messages, as a server alone does at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from qmq.net.aio_client import AsyncConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.protocol.fields import bad, field
from qmq.replication.fetcher import REPLY_GRACE_S, split_address
from qmq.store.damage import MEND_GIVE_UP_S
from qmq.store.replication import ChunkError, split_chunk
from qmq.store.store import LogStore, StoreError

log = logging.getLogger("qmq.replication")

MAX_COPY_BYTES = 12 * 1024 * 1024  # one REPL_READ reply carries at most this (frames are 16 MiB)

Hidden = list[tuple[str, int]]  # (subject, seq) of the messages a region hid


def serve_copy(store: LogStore, group: str, body: dict[str, Any]) -> dict[str, Any]:
    """REPL_READ: this member's copy of the log from `start` to `end`, only if it is whole records
    that all pass their CRC and lie within what this member holds durable."""
    if field(body, "group", str) != group:
        raise bad(f"this server is a member of group {group!r}, not {body.get('group')!r}")
    start, end = field(body, "start", int), field(body, "end", int)
    if not 0 < end - start <= MAX_COPY_BYTES:
        raise bad(f"a copy is 1 to {MAX_COPY_BYTES} bytes, asked {start}..{end}")
    held_from, held_to = store.start_offset, store.durable_offset
    if start < held_from or end > held_to:
        raise RemoteError(
            ErrorCode.UNAVAILABLE, f"this member holds {held_from}..{held_to} durable, asked {start}..{end}"
        )
    data = store.read_bytes(start, end)
    try:
        split_chunk(data, start)
    except ChunkError as exc:
        raise RemoteError(ErrorCode.UNAVAILABLE, f"this member's copy is damaged too: {exc}") from None
    return {"data": data}


async def ask_copy(peer: str, group: str, start: int, end: int, *, token: str | None, client_id: str) -> bytes:
    """REPL_READ to `peer`: its copy of [start, end)."""
    host, port = split_address(peer)
    conn = await AsyncConnection.open(host, port, token=token, client_id=client_id)
    try:
        body = {"group": group, "start": start, "end": end}
        reply = await conn.request(RequestCode.REPL_READ, body, timeout=REPLY_GRACE_S)
    finally:
        await conn.close()
    return bytes(reply.get("data") or b"")


async def mend_damage(
    store: LogStore, peers: list[str], *, alone: bool, group: str, token: str | None, client_id: str
) -> Hidden:
    """One pass over the regions of `store` awaiting a mend whose attempt is due: each is copied from
    the first of `peers` (members holding it durable) that gives a good copy, or given up when
    `alone` (no other member) or after MEND_GIVE_UP_S. Returns the messages mended or lost, whose
    readers must look again."""
    settled: Hidden = []
    now = time.monotonic()
    for region in store.damage.awaiting(now):
        for peer in peers:
            try:
                data = await ask_copy(peer, group, region.start, region.end, token=token, client_id=client_id)
                settled += await asyncio.to_thread(store.mend, region.start, data)
            except (RemoteError, OSError, TimeoutError, ValueError, StoreError) as exc:
                log.warning("cannot mend %s..%d from %s: %s", region.where(), region.end, peer, exc)
                continue
            log.warning("mended %s..%d with the copy of %s", region.where(), region.end, peer)
            break
        else:
            store.damage.failed_attempt(region, now)
            if alone:
                settled += store.lose(region.start, "no other member in the group")
            elif now - region.found_at >= MEND_GIVE_UP_S:
                settled += store.lose(region.start, f"no member gave a good copy in {MEND_GIVE_UP_S:g} s")
    return settled
