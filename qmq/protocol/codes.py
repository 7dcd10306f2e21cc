"""Request codes: the u16 in a frame header that says what a request asks for.

Codes are stable on the wire: never renumber or reuse one. Ranges are reserved so that each server
can add its own without colliding with the others:

    1-99        the connection itself (handshake, ping)
    100-199     broker (send, pull, ack, ...)
    200-299     meta server (registration, routes, consumer groups, ...)
    300-399     delay server
    60000-65535 tests and experiments; never used by a shipped server

Error frames carry header code 0 and put their `ErrorCode` in the body (see docs/protocol.md).
"""

from __future__ import annotations

from enum import IntEnum, unique


@unique  # two codes with one number would silently be one request: fail at import instead
class RequestCode(IntEnum):
    HANDSHAKE = 1  # body {"version", "client_id", "token"}; the first frame on every connection
    PING = 2  # any body; a server answers with the same body

    # Broker (see docs/broker.md for the bodies).
    BROKER_SEND = 100  # {"messages": [{"id", "subject", "payload", "key", "tags"}]} -> {"stored", "rejected"}
    BROKER_PULL = 101  # {"subject", "group", "consumer", "max", "wait_ms", ...} -> {"batches": [...]}
    BROKER_ACK = 102  # {"acks": [[subject, group, consumer, last_pull], ...]} -> {}
    BROKER_NACK = 103  # {"nacks": [{...}]} -> {"outcomes": [...]}: retry later or dead-letter
    BROKER_HEARTBEAT = 104  # {"consumers": [[subject, group, consumer], ...]} -> {}
    BROKER_LEAVE = 105  # {"leaves": [[subject, group, consumer, seen], ...]} -> {"released"}: a consumer closes
    BROKER_RESET = 110  # {"subject", "group", "to": "earliest" | "latest" | seq} -> {"cursor"}
    BROKER_DEAD_LIST = 111  # {"subject", "group", "from", "max"} -> {"messages", "next"}
    BROKER_DEAD_REDRIVE = 112  # {"subject", "group", "seqs"?} -> {"redriven"}
    BROKER_STATS = 113  # {} -> {"group", "read_only", "subjects", "groups"}
    BROKER_LOOKUP = 114  # {"id"} | {"subject", "key"} -> {"messages": [{..., "life": [...]}]}
    BROKER_DEAD_PURGE = 115  # {"subject", "group", "seqs"?} -> {"purged"}
    BROKER_GROUP_CREATE = 116  # {"subject", "group", "to"} -> {"cursor", "created"}
    BROKER_GROUP_DELETE = 117  # {"subject", "group", "force"} -> {"deleted"}
    BROKER_CONSUMERS = 118  # {} -> {"consumers": [...]}: every consumer, with what its worker reported

    # Replication between the servers of a group (see docs/replication.md for the bodies).
    REPL_FETCH = (
        120  # {"group", "replica", "epoch", "offset", "max_bytes", "wait_ms"} -> {"epoch", "data", "end", "epochs"}
    )
    REPL_EPOCH_END = 121  # {"epoch"} -> {"epoch", "end_offset"}: where that epoch ends in the master's log
    REPL_HANDOFF = (
        122  # to a master: {"to"?, "timeout_ms"} -> {"replica", "end", "epoch"}: sends stop, a replica catches up
    )
    REPL_SWITCH = 123  # to the meta server: {"group", "to"?} -> {"group", "epoch", "master"}: a manual failover
    # to the meta server: {"group", "address", "force"} -> {"group", "forgotten", "epoch", "master", "replicas"}:
    # a member gone for good leaves its group (`qmq admin group forget`)
    REPL_FORGET = 124
    # to any member of a group: {"group", "start", "end"} -> {"data"}: its copy of whole records [start, end),
    # CRC-checked, to mend a damaged region of the asker's log
    REPL_READ = 125
    # to a master that keeps state beside its log (a delay server's schedule), asked by a replica whose
    # offset retention removed: {"group", "replica", "epoch"} -> {"epoch", "offset", "log_start", "epochs",
    # "files": [[name, size], ...]}: that state as filed up to "offset" (docs/replication.md)
    REPL_SNAPSHOT = 126
    # {"epoch", "name", "offset", "size"} -> {"data", "gone"}: bytes of one file of a REPL_SNAPSHOT listing
    REPL_SNAPSHOT_READ = 127

    # Ordered subjects (docs/ordering.md); an ordered pull is a BROKER_PULL with "queues".
    BROKER_QUEUE_LOCK = 130  # {"subject", "group", "consumer", "queues", "release"} -> {"held", "members", ...}

    # Meta server (see docs/meta.md for the bodies).
    META_REGISTER = 200  # {"kind", "group", "address": "host:port"} -> {"heartbeat_interval_s", "read_only"}
    META_HEARTBEAT = 201  # same body and reply as META_REGISTER; an unknown server is registered
    META_UNREGISTER = 202  # {"address"} -> {"unregistered": bool}; a clean shutdown, unavailable at once
    META_ROUTE = 203  # {"subject", "create": bool} -> {"subject", "groups": [...], "delay_servers": [...]}
    META_SET_READ_ONLY = 204  # {"group", "read_only": bool} -> {"group", "read_only", "changed"}
    META_LIST = 205  # {} -> {"groups", "servers", "routes", ...}: everything, for admins and tests
    # Per-application credentials (docs/security.md); admin only.
    META_CREDENTIAL_CREATE = 206  # {"app", "produce": [pattern], "consume": [pattern], "admin"} -> {..., "token"}
    META_CREDENTIAL_LIST = 207  # {} -> {"credentials": [{"id", "app", "produce", "consume", "admin", ...}]}
    META_CREDENTIAL_REVOKE = 208  # {"id"} -> {"revoked": bool}
    META_CREDENTIAL_CHECK = 209  # {"token"} -> the credential's rights, or UNAUTHORIZED (servers ask)

    # Delay server (see docs/delay.md for the bodies).
    DELAY_SEND = 300  # {"messages": [{..., "deliver_at": ms}]} -> {"stored", "rejected"}, as BROKER_SEND
    DELAY_CANCEL = 301  # {"ids": [str]} -> {"outcomes": ["cancelled" | "too_late" | "unknown", ...]}
    DELAY_STATS = 302  # {} -> {"now_ms", "pending", "buckets", "fired", ...}
    DELAY_LOOKUP = 303  # {"id"} | {"subject", "key"} -> {"messages": [{..., "state", "deliver_at"}]}
