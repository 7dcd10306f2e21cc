"""Faults for a replicated group under load (tests/test_replication_chaos.py,
tests/test_pipeline_chaos.py, tests/test_delay_chaos.py): a group of two members (brokers, or delay
servers) under two meta servers on one database, and what can happen to it, each fault a function
that leaves `Cluster` naming who is master now. `Cluster.whole_again` waits until the group is whole
and takes sends again; `Sender` is the load, `drawn` a soak run's faults. For the runs of the whole
path, `Pipeline` holds the processes that run on the group (workers, a relay), with their faults,
and `rounds` hits them fault after fault."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from qmq.client import Client, OutgoingMessage, SendResult
from tests.support.broker import Broker, restart_broker
from tests.support.replication import (
    HOST,
    meta_in_sync,
    replication,
    start_group,
    start_meta,
    wait_in_sync,
    wait_role,
)
from tests.support.waiting import wait_until

# A whole group (its replica in sync, the meta server knowing it) takes sends again within this.
WRITABLE_WITHIN_S = 10.0


@dataclass
class Cluster:
    """The group's two members (the master first), the meta servers and their shared database.
    `group` is the group's name at the meta server ("delay:d1" for a delay-server group),
    `restart_member` how a member starts again on its disk."""

    processes: Any
    db_url: str
    members: list[Broker]
    metas: list[tuple[Any, int]]
    group: str = "g1"
    restart_member: Callable[..., Broker] = restart_broker
    epoch: int = 1
    restarts: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def meta(self) -> str:
        return ",".join(f"{HOST}:{port}" for _, port in self.metas)

    @property
    def master(self) -> Broker:
        return self.members[0]

    @property
    def replica(self) -> Broker:
        return self.members[1]

    def restart(self, member: Broker) -> Broker:
        self.restarts[member.address] += 1
        return self.restart_member(self.processes, member, name=f"{member.port}-back{self.restarts[member.address]}")

    def whole_again(self) -> None:
        """Wait until the master (of `epoch`) has its replica in sync and the meta server knows it."""
        wait_role(self.master, "master", epoch=self.epoch)
        wait_role(self.replica, "replica", epoch=self.epoch)
        wait_in_sync(self.master, self.replica)
        meta_in_sync(self.meta, self.group, self.replica)
        wait_until(
            lambda: (replication(self.master) or {}).get("writable"),
            f"{self.master.address} to take sends",
            WRITABLE_WITHIN_S,
            explain=lambda: f"its replication stats: {replication(self.master)}",
        )


def kill_the_master(cluster: Cluster) -> None:
    """SIGKILL the master: the replica takes office; the old master starts again on its disk and
    rejoins as replica."""
    master, replica = cluster.members
    cluster.processes.kill(master.proc, signal.SIGKILL)
    cluster.epoch += 1
    wait_role(replica, "master", epoch=cluster.epoch)
    cluster.members = [replica, cluster.restart(master)]


def freeze_the_master(cluster: Cluster) -> None:
    """SIGSTOP the master until the replica took office, then SIGCONT: the old master, deposed,
    fences itself and rejoins as replica without a restart."""
    master, replica = cluster.members
    os.killpg(master.proc.pid, signal.SIGSTOP)
    try:
        cluster.epoch += 1
        wait_role(replica, "master", epoch=cluster.epoch)
    finally:
        os.killpg(master.proc.pid, signal.SIGCONT)
    cluster.members = [replica, master]


def kill_the_replica(cluster: Cluster) -> None:
    """SIGKILL the replica: the group turns read-only after --max-lag (sends wait), then the replica
    starts again and catches up."""
    cluster.processes.kill(cluster.replica.proc, signal.SIGKILL)
    cluster.members[1] = cluster.restart(cluster.replica)


def hand_over(cluster: Cluster) -> None:
    """`qmq admin failover`: the master is switched by hand under load."""
    done = subprocess.run(
        [sys.executable, "-m", "qmq", "admin", "failover", "--group", cluster.group, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "QMQ_META": cluster.meta, "QMQ_TOKEN": ""},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    switched = json.loads(done.stdout)
    cluster.epoch += 1
    assert (switched["old_master"], switched["master"], switched["epoch"]) == (
        cluster.master.address,
        cluster.replica.address,
        cluster.epoch,
    )
    cluster.members.reverse()


def kill_a_meta_server(cluster: Cluster) -> None:
    """SIGKILL one of the two meta servers (maybe the one deciding failovers) and start it again."""
    i = random.randrange(len(cluster.metas))
    proc, port = cluster.metas[i]
    cluster.processes.kill(proc, signal.SIGKILL)
    cluster.metas[i] = start_meta(cluster.processes, cluster.db_url, port=port, name=f"meta{i + 1}-back")


def start_metas(processes, db_url: str) -> list[tuple[Any, int]]:
    """Two meta servers sharing `db_url`."""
    return [start_meta(processes, db_url, name=f"meta{i}") for i in (1, 2)]


def start_cluster(processes, tmp_path, db_url: str, *member_args: str) -> Cluster:
    """Two meta servers on `db_url` and a broker group g1 of two members (with `member_args`), the
    first master."""
    cluster = Cluster(processes, db_url, [], start_metas(processes, db_url))
    cluster.members = list(start_group(processes, tmp_path, cluster.meta, "g1", *member_args))
    return cluster


# In CI's order a hand-over comes right before a failover back to the member that handed over: it
# was refused sends for a minute after such a failover (a hand-over's hold outlived its term).
FAULTS = (hand_over, kill_the_master, freeze_the_master, kill_the_replica, kill_a_meta_server)


def drawn(faults: Sequence[Callable[..., None]], rounds: int) -> list[Callable[..., None]]:
    """`rounds` faults drawn at random for a soak run, by a seed that is printed (`QMQ_CHAOS_SEED`
    repeats a draw); the same seed also makes the faults' own random choices."""
    seed = int(os.environ.get("QMQ_CHAOS_SEED") or random.randrange(1 << 32))
    print(f"QMQ_CHAOS_SEED={seed}")
    chooser = random.Random(seed)
    random.seed(seed)  # which meta server, or worker, a fault picks
    return [chooser.choice(faults) for _ in range(rounds)]


class Sender(threading.Thread):
    """Sends batches (`batch(n)`: messages numbered from n) through a plain `Client` until stopped; a
    message that failed is sent again, with the same id, until acknowledged. Each result goes to
    `on_result`; an exception ends it and is kept in `error` for the test."""

    def __init__(self, meta: str, name: str) -> None:
        super().__init__(daemon=True, name=name)
        self.client = Client(meta=meta, client_id=name)
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def batch(self, n: int) -> list[OutgoingMessage]:
        raise NotImplementedError

    def on_result(self, message: OutgoingMessage, result: SendResult) -> None:
        raise NotImplementedError

    def run(self) -> None:
        n = 0
        try:
            while not self.stopping.is_set():
                batch = self.batch(n)
                n += len(batch)
                while batch:
                    results = self.client.send(batch)
                    for message, result in zip(batch, results, strict=True):
                        self.on_result(message, result)
                    batch = [m for m, r in zip(batch, results, strict=True) if not r.ok]
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.client.close()


@dataclass
class Pipeline:
    """The group, and the processes that run on it: workers by name and a relay, which a subclass
    says how to start (`start_worker`, `start_relay`)."""

    cluster: Cluster
    processes: Any
    db_url: str
    workers: dict[str, Any] = field(default_factory=dict)
    relay: Any = None
    restarts: int = 0

    def start_worker(self, name: str) -> None:
        raise NotImplementedError

    def start_relay(self) -> None:
        raise NotImplementedError


def on_the_group(fault: Callable[[Cluster], None]) -> Callable[[Pipeline], None]:
    """A fault of the group, as a fault of the pipeline on it."""

    def run(pipeline: Pipeline) -> None:
        fault(pipeline.cluster)

    run.__name__ = fault.__name__
    return run


def kill_a_worker(pipeline: Pipeline) -> None:
    """SIGKILL a worker in the middle of its handlers and start it again under the same name: what it
    held is handed out again (after the consumer timeout, or an ordered queue's lease), and its
    idempotency record (or its transaction's rollback) keeps the effect single."""
    name = random.choice(sorted(pipeline.workers))
    pipeline.processes.kill(pipeline.workers[name], signal.SIGKILL)
    pipeline.start_worker(name)


def kill_the_relay(pipeline: Pipeline) -> None:
    """SIGKILL the relay (its claimed rows' locks, and ordered keys' locks, go with its connections)
    and start it again."""
    pipeline.processes.kill(pipeline.relay, signal.SIGKILL)
    pipeline.start_relay()


def rounds(
    pipeline: Pipeline,
    faults: Sequence[Callable[[Pipeline], None]],
    handled: Callable[[], int],
    progress: int,
    within_s: float = 60.0,
    after_each: Callable[[int], None] = lambda n: None,
) -> None:
    """Fault after fault: after each the group must be whole again and `progress` more messages
    `handled` within `within_s`; then `after_each(round)` checks what the test promises so far."""
    for n, fault in enumerate(faults, 1):
        began = time.monotonic()
        fault(pipeline)
        pipeline.cluster.whole_again()
        whole = time.monotonic() - began
        done = handled()
        wait_until(lambda d=done: handled() >= d + progress, f"round {n}: the workers to go on", within_s)
        print(
            f"round {n}: {fault.__name__}: whole again after {whole:.1f} s, handling going on after "
            f"{time.monotonic() - began:.1f} s",
            flush=True,
        )
        after_each(n)
