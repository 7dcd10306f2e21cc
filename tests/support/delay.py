"""Delay servers as real processes, and a consumer thread that notes when each message arrived, for
the delay server's tests."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from delay_server.dispatch_log import SUFFIX as DISPATCH_SUFFIX
from delay_server.dispatch_log import read_entries
from delay_server.verify import iter_scheduled
from qmq.client import Client
from qmq.protocol.codes import RequestCode
from tests.support.broker import Broker, start_server


class DelayServer(Broker):
    """A `qmq delay-server` process (a `Broker` for its process, port, data directory and arguments)."""

    stats_code = RequestCode.DELAY_STATS

    def stats(self) -> dict[str, Any]:
        with self.connect(client_id="delay-test") as conn:
            return conn.request(RequestCode.DELAY_STATS, {})


def start_delay_server(
    processes, data_dir: Path, *args: str, port: int | None = None, name: str = "delay", env: dict | None = None
) -> DelayServer:
    """`qmq delay-server` on `data_dir` with `args` (--broker or --meta, ...); returns once it listens.
    `env`: more environment (a crash point, qmq/replication/crash_points.py); not kept for a restart."""
    return DelayServer(*start_server(processes, "delay-server", data_dir, args, port, name, env), data_dir, tuple(args))


def restart_delay_server(processes, server: DelayServer, name: str = "delay-restarted") -> DelayServer:
    return start_delay_server(processes, server.data_dir, *server.args, port=server.port, name=name)


def dispatched_ids(data_dir: Path) -> set[str]:
    """Ids of the messages the dispatch logs record as delivered (read from the files)."""
    positions: dict[str, set[int]] = defaultdict(set)
    for path in (data_dir / "dispatch").glob("*" + DISPATCH_SUFFIX):
        positions[path.name[: -len(DISPATCH_SUFFIX)]].update(read_entries(path)[0])
    return {r.message_id for bucket, r in iter_scheduled(data_dir) if r.offset in positions[bucket]}


@dataclass
class Arrivals:
    """A consumer of one subject on its own thread: every delivery with the time it arrived (ms)."""

    client: Client
    subject: str
    group: str = "delay-test"
    received: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    stored_at: dict[str, int] = field(default_factory=dict)
    bodies: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._subscription = self.client.subscribe(self.subject, self.group, start="earliest")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for delivery in self._subscription.pull(max=512, wait_s=0.5):
                now = time.time_ns() // 1_000_000
                with self._lock:
                    self.received[delivery.id].append(now)
                    self.stored_at[delivery.id] = int(delivery.stored_at.timestamp() * 1000)
                    self.bodies[delivery.id] = delivery.body
                self._subscription.ack(delivery)

    def count(self) -> int:
        with self._lock:
            return len(self.received)

    def wait_for(self, ids: set[str], deadline_s: float) -> set[str]:
        """Wait until every id arrived or the deadline passed; the ids still missing."""
        deadline = time.monotonic() + deadline_s
        while True:
            with self._lock:
                missing = ids - self.received.keys()
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)  # the consumer thread fills `received`; polled with a deadline

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._subscription.close()
