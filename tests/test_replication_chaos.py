"""Fault after fault while a producer and a consumer run, with real processes, SIGKILL and SIGSTOP (a
bounded Jepsen-style run, docs/replication.md). A replicated group of two brokers (`--ack-replicas
1`) under two meta servers on one PostgreSQL database; each round does one of FAULTS to it, waits
until the group is whole again (both members in sync, the meta server knowing it) and until both
sides got on. The producer is a plain `Client` (its sends wait out each fault: the delivery
timeout); the consumer subscribes through all of it. Promised: every message a broker acknowledged
is consumed (duplicates are allowed: at least once), nothing is consumed that was not sent, the
epoch counts the failovers, and both members' logs verify at the end.

CI runs each fault once; `pytest -m soak tests/test_replication_chaos.py` runs twenty-five rounds
of faults drawn at random (the seed is printed; `QMQ_CHAOS_SEED` repeats a run)."""

from __future__ import annotations

import collections
import contextlib
import signal
import threading
import time

import pytest

from qmq.client import Client, OutgoingMessage, SendResult
from tests.support import chaos
from tests.support.databases import fresh_database
from tests.support.replication import replication, wait_for
from tests.support.stores import assert_log_verifies

SUBJECT = "chaos.orders"
BATCH = 20
PROGRESS = 100  # messages each side must get through after a round, before the next one starts
DRAIN_TIMEOUT_S = 120.0
SOAK_ROUNDS = 25


class Producer(chaos.Sender):
    """Sends until stopped. `acked` holds what a broker acknowledged; `failed` counts results that
    were not, by code."""

    def __init__(self, meta: str) -> None:
        super().__init__(meta, "chaos-producer")
        self.sent: set[str] = set()
        self.acked: list[str] = []
        self.failed = collections.Counter[int]()
        self.last_failure = ""

    def batch(self, n: int) -> list[OutgoingMessage]:
        batch = [OutgoingMessage(SUBJECT, f"m{i}", key=str(i)) for i in range(n, n + BATCH)]
        self.sent.update(m.id for m in batch)
        return batch

    def on_result(self, message: OutgoingMessage, result: SendResult) -> None:
        if result.ok:
            self.acked.append(result.message_id)
        else:
            self.failed[result.error_code] += 1
            self.last_failure = result.error or ""


class Consumer(threading.Thread):
    """Consumes SUBJECT as group "c", acking each, until stopped and every id of `want` came."""

    def __init__(self, meta: str) -> None:
        super().__init__(daemon=True, name="chaos-consumer")
        self.meta = meta
        self.got: list[str] = []
        self.copies: list[tuple[str, object]] = []  # (id, stored_at): a copy delivered twice, or two copies
        self.want: set[str] | None = None  # set when the producer stopped: drain until all came
        self.error: BaseException | None = None

    def run(self) -> None:
        seen: set[str] = set()
        try:
            with (
                Client(meta=self.meta, client_id="chaos-consumer") as client,
                client.subscribe(SUBJECT, "c", start="earliest") as sub,
            ):
                while self.want is None or not self.want <= seen:
                    for delivery in sub.pull(max=256, wait_s=0.5):
                        self.got.append(delivery.id)
                        self.copies.append((delivery.id, delivery.stored_at))
                        seen.add(delivery.id)
                        sub.ack(delivery)
                sub.flush()
        except BaseException as exc:
            self.error = exc


def faults_in_a_row(processes, tmp_path, pg_url, faults) -> None:
    with fresh_database(pg_url) as url, contextlib.ExitStack() as stack:
        cluster = chaos.start_cluster(processes, tmp_path, url)
        producer, consumer = Producer(cluster.meta), Consumer(cluster.meta)
        producer.start()
        consumer.start()
        stack.callback(producer.stopping.set)  # a failed round ends them too
        stack.callback(setattr, consumer, "want", set())
        wait_for(lambda: len(consumer.got) >= PROGRESS, "the consumer to get going")
        for n, fault in enumerate(faults, 1):
            began, failed = time.monotonic(), producer.failed.total()
            fault(cluster)
            cluster.whole_again()
            whole = time.monotonic() - began
            acked, got = len(producer.acked), len(consumer.got)
            wait_for(lambda a=acked: len(producer.acked) >= a + PROGRESS, f"round {n}: the producer to go on")
            producing = time.monotonic() - began
            wait_for(lambda g=got: len(consumer.got) >= g + PROGRESS, f"round {n}: the consumer to go on")
            print(
                f"round {n}: {fault.__name__}: whole again after {whole:.1f} s, the producer going on after "
                f"{producing:.1f} s, the consumer after {time.monotonic() - began:.1f} s"
                + (f"; sends failed: {producer.last_failure}" if producer.failed.total() > failed else ""),
                flush=True,
            )
            assert producer.error is None and consumer.error is None, (producer.error, consumer.error)

        producer.stopping.set()
        producer.join(timeout=60)
        assert not producer.is_alive() and producer.error is None, producer.error
        acked = set(producer.acked)
        consumer.want = acked
        consumer.join(timeout=DRAIN_TIMEOUT_S)
        assert consumer.error is None, consumer.error
        consumed = set(consumer.got)
        assert not consumer.is_alive(), f"{len(acked - consumed)} of {len(acked)} acknowledged messages never consumed"
        assert acked <= consumed
        assert consumed <= producer.sent, f"{len(consumed - producer.sent)} consumed messages were never sent"
        copies = set(consumer.copies)
        print(
            f"{len(faults)} faults: {len(acked):,} acknowledged, {len(consumer.got):,} deliveries, "
            f"{len(consumer.got) - len(consumed)} duplicates ({len(consumer.copies) - len(copies)} a stored copy "
            f"delivered again, {len(copies) - len(consumed)} stored twice by a send repeated after a failover), "
            f"failed sends by code {dict(producer.failed)}"
        )
        assert replication(cluster.master)["epoch"] == cluster.epoch
        for member in cluster.members:
            processes.kill(member.proc, signal.SIGTERM)
            assert_log_verifies(member.data_dir)


def test_each_fault_under_a_running_producer_and_consumer_loses_nothing(processes, tmp_path, pg_url) -> None:
    faults_in_a_row(processes, tmp_path, pg_url, chaos.FAULTS)


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_random_faults_under_a_running_producer_and_consumer_lose_nothing(processes, tmp_path, pg_url) -> None:
    faults_in_a_row(processes, tmp_path, pg_url, chaos.drawn(chaos.FAULTS, SOAK_ROUNDS))
