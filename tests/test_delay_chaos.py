"""A replicated delay-server group under fault after fault (tests/support/chaos.py: the master
SIGKILLed or frozen, the replica SIGKILLed, a hand-over, a meta server SIGKILLed) while a producer
schedules messages due 0.3 - 2 s ahead and a consumer takes them from the broker they are fired to.
Promised (docs/delay.md, docs/replication.md): every message the delay server acknowledged reaches
the consumer exactly once (a re-fire after a failover is dropped by the broker), and none before it
is due.

CI runs each fault once; `pytest -m soak tests/test_delay_chaos.py` runs twenty drawn at random
(`QMQ_CHAOS_SEED` repeats a draw)."""

from __future__ import annotations

import contextlib
import random
import time

import pytest

from qmq.client import Client, OutgoingMessage, SendResult
from tests.support import chaos
from tests.support.broker import start_broker
from tests.support.databases import fresh_database
from tests.support.delay import Arrivals, restart_delay_server
from tests.support.replication import meta_in_sync, start_delay_member, wait_for, wait_in_sync, wait_role

SUBJECT = "chaos.reminders"
BATCH = 20
DUE_S = (0.3, 2.0)  # each message is due this far ahead of its send, at random
PROGRESS = 100  # messages the consumer must get after a round, before the next one starts
DRAIN_TIMEOUT_S = 120.0
EARLY_SLACK_MS = 5  # clocks read in different processes
SOAK_ROUNDS = 20


class Scheduler(chaos.Sender):
    """Schedules until stopped; `due` holds the due time (ms) of every acknowledged message."""

    def __init__(self, meta: str) -> None:
        super().__init__(meta, "chaos-scheduler")
        self.due: dict[str, int] = {}

    def batch(self, n: int) -> list[OutgoingMessage]:
        now_ms = time.time_ns() // 1_000_000
        return [
            OutgoingMessage(SUBJECT, {"n": i}, deliver_at=now_ms + int(random.uniform(*DUE_S) * 1000))
            for i in range(n, n + BATCH)
        ]

    def on_result(self, message: OutgoingMessage, result: SendResult) -> None:
        if result.ok:
            self.due[message.id] = message.deliver_at


def start_delay_cluster(processes, tmp_path, db_url: str) -> chaos.Cluster:
    """Two meta servers, a broker group b1 of one broker, and the delay group d1 of two members."""
    cluster = chaos.Cluster(
        processes, db_url, [], chaos.start_metas(processes, db_url), "delay:d1", restart_delay_server
    )
    start_broker(processes, tmp_path / "broker", "--meta", cluster.meta, "--group", "b1")
    a = start_delay_member(processes, tmp_path / "a", cluster.meta, "a")
    wait_role(a, "master")
    b = start_delay_member(processes, tmp_path / "b", cluster.meta, "b")
    wait_role(b, "replica")
    wait_in_sync(a, b)
    meta_in_sync(cluster.meta, cluster.group, b)
    cluster.members = [a, b]
    return cluster


def faults_in_a_row(processes, tmp_path, pg_url, faults) -> None:
    with fresh_database(pg_url) as url, contextlib.ExitStack() as stack:
        cluster = start_delay_cluster(processes, tmp_path, url)
        consumer = Arrivals(Client(meta=cluster.meta), SUBJECT)
        stack.callback(consumer.close)
        scheduler = Scheduler(cluster.meta)
        scheduler.start()
        stack.callback(scheduler.stopping.set)  # a failed round ends it too
        wait_for(lambda: consumer.count() >= PROGRESS, "the consumer to get going")
        for n, fault in enumerate(faults, 1):
            began = time.monotonic()
            fault(cluster)
            cluster.whole_again()
            whole = time.monotonic() - began
            got = consumer.count()
            wait_for(lambda g=got: consumer.count() >= g + PROGRESS, f"round {n}: the consumer to go on")
            print(
                f"round {n}: {fault.__name__}: whole again after {whole:.1f} s, "
                f"deliveries going on after {time.monotonic() - began:.1f} s",
                flush=True,
            )
            assert scheduler.error is None, scheduler.error

        scheduler.stopping.set()
        scheduler.join(timeout=60)
        assert not scheduler.is_alive() and scheduler.error is None, scheduler.error
        due = dict(scheduler.due)
        missing = consumer.wait_for(set(due), DRAIN_TIMEOUT_S)
        assert not missing, f"{len(missing)} of {len(due)} acknowledged messages never arrived"
        received = dict(consumer.received)
        assert set(received) <= set(due), f"{len(set(received) - set(due))} messages came that were never scheduled"
        twice = {i: times for i, times in received.items() if len(times) > 1}
        assert not twice, f"{len(twice)} messages reached the consumer more than once"
        early = {i: due[i] - times[0] for i, times in received.items() if times[0] < due[i] - EARLY_SLACK_MS}
        assert not early, f"{len(early)} messages came early, by up to {max(early.values())} ms"
        late_s = sorted((times[0] - due[i]) / 1000 for i, times in received.items())
        print(
            f"{len(faults)} faults: {len(due):,} scheduled, each delivered once, none early; lateness p50 "
            f"{late_s[len(late_s) // 2]:.2f} s, p99 {late_s[len(late_s) * 99 // 100]:.2f} s, max {late_s[-1]:.2f} s"
        )


def test_each_fault_of_a_delay_group_delivers_every_message_once_never_early(processes, tmp_path, pg_url) -> None:
    faults_in_a_row(processes, tmp_path, pg_url, chaos.FAULTS)


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_random_faults_of_a_delay_group_deliver_every_message_once_never_early(processes, tmp_path, pg_url) -> None:
    faults_in_a_row(processes, tmp_path, pg_url, chaos.drawn(chaos.FAULTS, SOAK_ROUNDS))
