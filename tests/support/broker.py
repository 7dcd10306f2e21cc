"""Brokers as real processes, and a minimal consumer over the raw protocol, for the broker's tests.

`RawConsumer` speaks docs/broker.md directly (no client library), so the broker's tests check the
broker alone: it keeps the last pull sequence seen per stored subject and acks prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from qmq.net.client import BlockingConnection
from qmq.protocol.codes import RequestCode
from tests.support.processes import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


@dataclass
class Broker:
    proc: Any
    port: int
    data_dir: Path
    args: tuple[str, ...]
    stats_code: ClassVar[RequestCode] = RequestCode.BROKER_STATS  # its replication stats come with these

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def connect(self, token: str | None = "", client_id: str = "broker-test") -> BlockingConnection:
        return BlockingConnection.open(HOST, self.port, client_id=client_id, token=token)


def start_broker(
    processes, data_dir: Path, *args: str, port: int | None = None, name: str = "broker", env: dict | None = None
) -> Broker:
    """`qmq broker` on `data_dir` (sync flush unless `args` say otherwise); returns once it listens.
    `env`: more environment (a crash point, qmq/replication/crash_points.py); not kept for a restart."""
    return Broker(*start_server(processes, "broker", data_dir, args, port, name, env), data_dir, tuple(args))


def start_server(
    processes,
    command: str,
    data_dir: Path,
    args: tuple[str, ...],
    port: int | None,
    name: str,
    env: dict | None = None,
) -> tuple[Any, int]:
    """`qmq COMMAND` (a server with a data directory) on `port` (None: a free one), with no token or
    meta server from the environment (and `env` added); its process and port, once it listens."""
    port = port or free_port()
    proc = processes.start(
        ["-m", "qmq", command, "--data-dir", str(data_dir), "--port", str(port), *args],
        name=name,
        env={"PYTHONPATH": str(ROOT), "QMQ_TOKEN": "", "QMQ_META": "", **(env or {})},
    )
    wait_for_port(port, proc)
    return proc, port


def restart_broker(processes, broker: Broker, name: str = "broker-restarted") -> Broker:
    return start_broker(processes, broker.data_dir, *broker.args, port=broker.port, name=name)


def send(
    conn: BlockingConnection, subject: str, ids: list[str], *, payload: bytes = b"x", tags=(), key: str | None = None
) -> dict[str, Any]:
    messages = [{"id": i, "subject": subject, "payload": payload, "tags": list(tags), "key": key} for i in ids]
    return conn.request(RequestCode.BROKER_SEND, {"messages": messages})


@dataclass
class Delivered:
    id: str
    stored_subject: str
    group: str
    pull_seq: int
    attempt: int
    tags: list[str]
    payload: bytes


@dataclass
class RawConsumer:
    conn: BlockingConnection
    subject: str
    group: str
    consumer: str
    options: dict[str, Any] = field(default_factory=dict)  # tags, match_all, broadcast, start
    pulled: dict[str, int] = field(default_factory=dict)  # stored subject -> last pull seq seen

    def pull(self, max_count: int = 64, wait_ms: int = 2500) -> list[Delivered]:
        body = {
            "subject": self.subject,
            "group": self.group,
            "consumer": self.consumer,
            "max": max_count,
            "wait_ms": wait_ms,
            "pulled": self.pulled,
            **self.options,
        }
        reply = self.conn.request(RequestCode.BROKER_PULL, body, timeout=wait_ms / 1000 + 30)
        out = []
        for batch in reply["batches"]:
            if batch.get("behind"):  # the broker's pull log ends there (a failover): as the client, go on from it
                self.pulled[batch["subject"]] = batch["first_pull"] - 1
                continue
            for i, m in enumerate(batch["messages"]):
                out.append(
                    Delivered(
                        m["id"],
                        batch["subject"],
                        batch["group"],
                        batch["first_pull"] + i,
                        m["attempt"],
                        m["tags"],
                        m["payload"],
                    )
                )
            last = batch["first_pull"] + len(batch["messages"]) - 1
            self.pulled[batch["subject"]] = max(self.pulled.get(batch["subject"], -1), last)
        return out

    def ack(self, deliveries: list[Delivered]) -> None:
        """Ack the prefix up to the highest pull seq of each stored subject in `deliveries`."""
        last: dict[tuple[str, str], int] = {}
        for d in deliveries:
            k = (d.stored_subject, d.group)
            last[k] = max(last.get(k, -1), d.pull_seq)
        acks = [[s, g, self.consumer, p] for (s, g), p in last.items()]
        if acks:
            self.conn.request(RequestCode.BROKER_ACK, {"acks": acks})

    def nack(
        self,
        d: Delivered,
        delay_ms: int,
        *,
        dead: bool = False,
        max_attempts: int | None = None,
        reason: str = "test failure",
    ) -> list:
        nack = {
            "subject": d.stored_subject,
            "group": d.group,
            "consumer": self.consumer,
            "pull_seq": d.pull_seq,
            "attempt": d.attempt,
            "delay_ms": delay_ms,
            "dead": dead,
            "reason": reason,
        }
        if max_attempts is not None:
            nack["max_attempts"] = max_attempts
        return self.conn.request(RequestCode.BROKER_NACK, {"nacks": [nack]})["outcomes"][0]

    def drain(
        self, expected: int, *, ack: bool = True, max_count: int = 256, empty_pulls: int = 3, wait_ms: int = 1000
    ) -> list[Delivered]:
        """Pull (and ack) until `expected` messages came or `empty_pulls` pulls in a row came back empty."""
        got: list[Delivered] = []
        empty = 0
        while len(got) < expected and empty < empty_pulls:
            batch = self.pull(max_count, wait_ms)
            empty = 0 if batch else empty + 1
            got.extend(batch)
            if ack:
                self.ack(batch)
        return got
