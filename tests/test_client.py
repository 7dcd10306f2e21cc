"""The client library and `qmq send` / `qmq tail` against real `qmq broker` (and `qmq meta`) processes:
round trips, per-message rejection, retries on another group when a broker is SIGKILLed, nack and
redelivery, acknowledgements that survive a broker restart, and the command line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from qmq.client import AsyncClient, Client, Delivery, MetaUnreachable, NoRoute, OutgoingMessage, SendError
from qmq.client.deliveries import MAX_PULL_WAIT_S
from qmq.client.routes import META_TIMEOUT_S
from qmq.net.client import BlockingConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode
from qmq.protocol.limits import MAX_MESSAGE_BYTES
from tests.support.broker import ROOT, Broker, restart_broker, start_broker
from tests.support.databases import fresh_database
from tests.support.processes import free_port, wait_for_port
from tests.support.replication import start_meta as start_meta_on
from tests.support.replication import wait_role
from tests.test_meta import wait_until as poll_until

HOST = "127.0.0.1"
DRAIN_TIMEOUT_S = 30.0  # a test's messages must all arrive within this
CLI_TIMEOUT_S = 60.0
ENV = {"PYTHONPATH": str(ROOT), "QMQ_TOKEN": "", "QMQ_META": ""}


@pytest.fixture
def brokers(processes, tmp_path) -> list[Broker]:
    return [start_broker(processes, tmp_path / f"broker{i}", name=f"broker{i}") for i in range(2)]


@pytest.fixture
def client(brokers):
    with Client(brokers=[b.address for b in brokers], client_id="client-test") as c:
        yield c


def drain(subscription, expected: int, *, ack: bool = True, timeout_s: float = DRAIN_TIMEOUT_S) -> list[Delivery]:
    """Pull until `expected` deliveries came (acking each), failing after `timeout_s`."""
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < expected:
        assert time.monotonic() < deadline, f"only {len(got)} of {expected} messages within {timeout_s} s"
        for delivery in subscription.pull(max=64, wait_s=1.0):
            got.append(delivery)
            if ack:
                subscription.ack(delivery)
    return got


def unfinished(brokers: list[Broker], subject: str, group: str) -> int:
    """Messages of `subject` the brokers hold for `group` that were not acknowledged (handed out or
    not): what a consumer that says it acknowledged everything must leave at zero."""
    total = 0
    for broker in brokers:
        with broker.connect() as conn:
            stats = conn.request(RequestCode.BROKER_STATS, {})
        for item in stats["groups"]:
            if item["subject"] == subject and item["group"] == group:
                total += item["in_flight"] + item["backlog"]
    return total


def wait_until(condition: Callable[[], Any], what: str, timeout_s: float = DRAIN_TIMEOUT_S) -> Any:
    """Poll another process's state, where there is no event to wait on."""
    return poll_until(condition, what, timeout_s)


# ---- the blocking client -----------------------------------------------------------------------------


def test_send_pull_ack_round_trip(client, brokers) -> None:
    subscription = client.subscribe("order.created", "billing")
    bodies = [{"n": i} if i % 3 == 0 else (f"text {i}" if i % 3 == 1 else bytes([i % 256]) * 3) for i in range(90)]
    messages = [
        OutgoingMessage("order.created", body, key=f"k{i}", tags=["new"] if i % 2 else [], headers={"i": str(i)})
        for i, body in enumerate(bodies)
    ]
    results = client.send(messages)
    assert [r.message_id for r in results] == [m.id for m in messages]
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert {r.group for r in results} == {b.address for b in brokers}  # spread over both groups

    got = drain(subscription, len(messages))
    by_id = {d.id: d for d in got}
    assert sorted(by_id) == sorted(m.id for m in messages) and len(got) == len(messages)
    for i, m in enumerate(messages):
        d = by_id[m.id]
        assert d.body == bodies[i] and d.key == f"k{i}" and d.headers == {"i": str(i)}
        assert d.tags == (("new",) if i % 2 else ()) and d.attempt == 1 and d.subject == "order.created"
        assert d.created_at is not None and d.stored_at is not None and d.created_at <= d.stored_at
    subscription.close()

    # The acknowledgements were flushed by close(): the group has nothing left.
    assert unfinished(brokers, "order.created", "billing") == 0
    again = client.subscribe("order.created", "billing", start="earliest")
    assert again.pull(wait_s=0.5) == []
    again.close()
    # Another group starting at the earliest message gets everything.
    audit = client.subscribe("order.created", "audit", start="earliest")
    assert sorted(d.id for d in drain(audit, len(messages))) == sorted(m.id for m in messages)


def test_latest_group_gets_what_is_sent_after_subscribe(client) -> None:
    client.send_one("late", "before")  # stored before the group exists: not for it
    subscription = client.subscribe("late", "g")
    sent = client.send_one("late", "after")
    [d] = drain(subscription, 1)
    assert (d.id, d.body) == (sent.message_id, "after")
    assert subscription.pull(wait_s=0.3) == []


def test_pull_does_not_wait_on_an_empty_group_while_another_has_data(client, brokers) -> None:
    subscription = client.subscribe("fast", "g")
    subscription.pull(wait_s=0)
    with Client(brokers=[brokers[1].address]) as only_b:
        sent = only_b.send_one("fast", "x")
    started = time.monotonic()
    got = subscription.pull(wait_s=MAX_PULL_WAIT_S)
    assert [d.id for d in got] == [sent.message_id]
    assert time.monotonic() - started < 5.0, "the pull waited on the empty group"


def test_rejected_messages_are_reported_and_the_rest_stored(client) -> None:
    too_big = OutgoingMessage("rej", b"x" * (MAX_MESSAGE_BYTES + 1))
    fine = [OutgoingMessage("rej", f"m{i}") for i in range(3)]
    bad_subject = OutgoingMessage("no spaces allowed", "x")
    results = client.send([fine[0], too_big, fine[1], bad_subject, fine[2]])
    assert [r.ok for r in results] == [True, False, True, False, True]
    assert results[1].error_code == ErrorCode.MESSAGE_TOO_LARGE and "MESSAGE_TOO_LARGE" in results[1].error
    assert results[3].error_code == ErrorCode.BAD_SUBJECT
    with pytest.raises(SendError) as info:
        client.send_one("rej", b"x" * (MAX_MESSAGE_BYTES + 1))
    assert info.value.result.error_code == ErrorCode.MESSAGE_TOO_LARGE
    subscription = client.subscribe("rej", "g", start="earliest")
    assert sorted(d.id for d in drain(subscription, 3)) == sorted(m.id for m in fine)
    assert subscription.pull(wait_s=0.3) == []


def test_send_moves_to_the_other_group_when_a_broker_is_killed(processes, client, brokers) -> None:
    a, b = brokers
    subscription = client.subscribe("kill", "g")
    warm = client.send([OutgoingMessage("kill", f"warm {i}") for i in range(20)])
    assert {r.group for r in warm} == {a.address, b.address}
    processes.kill(a.proc)

    messages = [OutgoingMessage("kill", f"after {i}") for i in range(50)]
    results = client.send(messages)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert {r.group for r in results} == {b.address}
    assert [r.message_id for r in results] == [m.id for m in messages]  # the same ids after the retry

    on_b = [r.message_id for r in warm if r.group == b.address] + [m.id for m in messages]
    assert sorted(d.id for d in drain(subscription, len(on_b))) == sorted(on_b)
    # Broker a comes back with the messages it had stored; the subscription reconnects and drains it.
    restart_broker(processes, a)
    on_a = [r.message_id for r in warm if r.group == a.address]
    assert sorted(d.id for d in drain(subscription, len(on_a))) == sorted(on_a)


def test_send_fails_clearly_when_no_broker_takes_it(processes, brokers) -> None:
    for broker in brokers:
        processes.kill(broker.proc)
    with Client(brokers=[b.address for b in brokers], delivery_timeout_s=1.0) as client:
        [result] = client.send([OutgoingMessage("dead", "x")])
    assert not result.ok and result.error_code == ErrorCode.UNAVAILABLE
    assert "not stored within 1 s (" in result.error and "cannot connect" in result.error
    with Client(brokers=[b.address for b in brokers], delivery_timeout_s=0) as client:
        [result] = client.send([OutgoingMessage("dead", "x")])
    assert not result.ok and "not stored after 3 attempts" in result.error and "cannot connect" in result.error


def test_nack_redelivers_with_the_next_attempt_then_dead_letters(client) -> None:
    subscription = client.subscribe("flaky", "g")
    sent = client.send_one("flaky", {"job": 1})
    [first] = drain(subscription, 1, ack=False)
    assert first.attempt == 1 and not first.is_retry
    outcome = subscription.nack(first, 0.2, reason="try again")
    assert outcome is not None and outcome[0] == "retry"
    [second] = drain(subscription, 1, ack=False)
    assert (second.id, second.attempt, second.body) == (sent.message_id, 2, {"job": 1})
    assert second.is_retry and second.subject == "flaky"
    outcome = subscription.nack(second, 0, dead=True, reason="give up")
    assert outcome is not None and outcome[0] == "dead"
    assert subscription.pull(wait_s=0.5) == []
    subscription.close()
    # Nothing comes back to the group: both deliveries were acknowledged after their nacks.
    with client.subscribe("flaky", "g") as again:
        assert again.pull(wait_s=0.5) == []


def test_unacknowledged_messages_come_back_after_a_close_with_their_attempt_counted(client) -> None:
    first = client.subscribe("resend", "g", consumer="worker-1")
    sent = [r.message_id for r in client.send([OutgoingMessage("resend", f"m{i}") for i in range(10)])]
    got = drain(first, 10, ack=False)
    for d in got[:4]:
        first.ack(d)
    first.close()  # the process "restarts": the same consumer id, no memory of what it saw
    second = client.subscribe("resend", "g", consumer="worker-1")
    acked = {d.id for d in got[:4]}
    again = drain(second, 10 - 4)
    # Acks are prefixes per broker: what was acked may come again only if an earlier one was not.
    assert set(sent) - acked <= {d.id for d in again}
    assert all(d.attempt == 2 and d.is_retry for d in again if d.id not in acked)  # handed out, then given back
    assert second.pull(wait_s=0.5) == []


def acked_on(broker: Broker, subject: str, group: str) -> tuple[int, int] | None:
    """(acknowledged, in flight) of a group on a broker, by BROKER_STATS."""
    with broker.connect() as conn:
        groups = conn.request(RequestCode.BROKER_STATS, {})["groups"]
    return next(((g["acked"], g["in_flight"]) for g in groups if (g["subject"], g["group"]) == (subject, group)), None)


def test_acks_across_broker_restarts_never_crash_the_consumer(processes, tmp_path) -> None:
    broker = start_broker(processes, tmp_path / "solo", name="solo")
    with Client(brokers=[broker.address]) as client:
        subscription = client.subscribe("restart", "g")
        client.send([OutgoingMessage("restart", f"m{i}") for i in range(5)])
        got = drain(subscription, 5, ack=False)
        processes.kill(broker.proc)
        for d in got:
            subscription.ack(d)
        subscription.flush()  # the broker is down: the acks wait, nothing is raised
        assert subscription.pull(wait_s=0.2) == []  # nor does a pull raise
        broker = restart_broker(processes, broker)
        # The broker journalled its pulls before handing them out, so it knows these pull sequences
        # after the crash: the acks that waited reach it, and nothing is delivered again.
        again: list[Delivery] = []

        def all_acked() -> bool:
            again.extend(subscription.pull(wait_s=0.2))  # (acks go out beside each pull)
            return acked_on(broker, "restart", "g") == (5, 0)

        poll_until(all_acked, "the acks that waited to reach the restarted broker")
        assert again == []
        assert all(subscription._state.is_current(d) for d in got)

        processes.kill(broker.proc)
        broker = restart_broker(processes, broker)
        assert subscription.pull(wait_s=1.0) == []  # the acks were durable
        sent = client.send_one("restart", "after")
        [d] = drain(subscription, 1)
        assert d.id == sent.message_id


def test_tags_filter_on_the_broker(client) -> None:
    subscription = client.subscribe("tagged", "g", tags=["red"])
    results = client.send([OutgoingMessage("tagged", i, tags=["red"] if i % 2 else ["blue"]) for i in range(10)])
    red = [r.message_id for i, r in enumerate(results) if i % 2]
    got = drain(subscription, len(red))
    assert sorted(d.id for d in got) == sorted(red)
    assert subscription.pull(wait_s=0.3) == []


def test_broadcast_consumers_each_get_every_message(client) -> None:
    one = client.subscribe("news", "readers", consumer="one", broadcast=True)
    two = client.subscribe("news", "readers", consumer="two", broadcast=True)
    shared = client.subscribe("news", "workers")
    sent = sorted(r.message_id for r in client.send([OutgoingMessage("news", i) for i in range(12)]))
    assert sorted(d.id for d in drain(one, 12)) == sent
    assert sorted(d.id for d in drain(two, 12)) == sent
    assert sorted(d.id for d in drain(shared, 12)) == sent


# ---- the asyncio client ------------------------------------------------------------------------------


def test_async_client_round_trip_nack_and_failover(processes, brokers) -> None:
    async def main() -> None:
        async with AsyncClient(brokers=[b.address for b in brokers], client_id="aio-test") as client:
            subscription = await client.subscribe("aio", "g")
            messages = [OutgoingMessage("aio", {"n": i}, key=str(i)) for i in range(40)]
            results = await client.send(messages)
            assert all(r.ok for r in results) and {r.group for r in results} == {b.address for b in brokers}
            got: list[Delivery] = []
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while len(got) < len(messages):
                assert time.monotonic() < deadline
                got.extend(await subscription.pull(wait_s=1.0))
            assert sorted(d.id for d in got) == sorted(m.id for m in messages)
            assert {d.id: d.body for d in got} == {m.id: m.body for m in messages}
            for d in got[1:]:
                await subscription.ack(d)
            assert (await subscription.nack(got[0], 0))[0] == "retry"
            [again] = await subscription.pull(wait_s=DRAIN_TIMEOUT_S)
            assert (again.id, again.attempt) == (got[0].id, 2)
            await subscription.ack(again)
            await subscription.flush()
            assert await subscription.pull(wait_s=0.3) == []

            processes.kill(brokers[0].proc)
            after = await client.send([OutgoingMessage("aio", f"after {i}") for i in range(10)])
            assert all(r.ok for r in after) and {r.group for r in after} == {brokers[1].address}
            with pytest.raises(SendError):
                await client.send_one("aio", b"x" * (MAX_MESSAGE_BYTES + 1))
            await subscription.close()

    asyncio.run(main())


def test_async_prefetch_reaches_the_broker_while_the_application_works(processes, tmp_path) -> None:
    """With `prefetch=True` the next pull is at the broker when `pull()` returns, not when the
    application next awaits: the broker hands out the second batch while this thread never yields."""
    broker = start_broker(processes, tmp_path / "broker")

    def in_flight() -> int:
        with broker.connect() as conn:
            groups = conn.request(RequestCode.BROKER_STATS, {})["groups"]
        return sum(g["in_flight"] for g in groups if (g["subject"], g["group"]) == ("ahead", "g"))

    async def main() -> None:
        async with AsyncClient(brokers=[broker.address]) as client:
            subscription = await client.subscribe("ahead", "g", prefetch=True)  # its registration: nothing yet
            with Client(brokers=[broker.address]) as sender:
                assert all(r.ok for r in sender.send([OutgoingMessage("ahead", {"n": i}) for i in range(30)]))
            first = await subscription.pull(max=10, wait_s=DRAIN_TIMEOUT_S)
            assert len(first) == 10
            wait_until(lambda: in_flight() == 20, "the pull ahead handed out the next 10", timeout_s=10.0)
            second = await subscription.pull(max=10, wait_s=DRAIN_TIMEOUT_S)
            assert [d.body["n"] for d in first + second] == list(range(20))
            await subscription.close()

    asyncio.run(main())


# ---- with a meta server ------------------------------------------------------------------------------


def start_meta(processes, tmp_path) -> str:
    port = free_port()
    proc = processes.start(
        ["-m", "qmq", "meta", "--port", str(port), "--db", f"sqlite:///{tmp_path / 'meta.db'}"], name="meta", env=ENV
    )
    wait_for_port(port, proc)
    return f"{HOST}:{port}"


def registered_groups(meta: str) -> set[str]:
    host, port = meta.split(":")
    with BlockingConnection.open(host, int(port), token="") as conn:
        listing = conn.request(RequestCode.META_LIST, {})
    return {g["name"] for g in listing["groups"] if g["available"]}


def test_with_a_meta_server_send_retries_on_the_other_group(processes, tmp_path) -> None:
    meta = start_meta(processes, tmp_path)
    brokers = [
        start_broker(processes, tmp_path / name, "--meta", meta, "--group", name, name=name) for name in ("ga", "gb")
    ]
    wait_until(lambda: registered_groups(meta) == {"ga", "gb"}, "both brokers registered")
    for broker in brokers:
        wait_role(broker, "master")  # else the warm-up's sends may all go to the other group
    with Client(meta=meta, client_id="meta-client") as client:
        subscription = client.subscribe("routed", "g")
        assert {g.name for g in client.route("routed").groups} == {"ga", "gb"}
        warm = client.send([OutgoingMessage("routed", i) for i in range(20)])
        assert {r.group for r in warm} == {"ga", "gb"}
        processes.kill(brokers[0].proc)  # the meta server still thinks ga is alive for a while
        results = client.send([OutgoingMessage("routed", f"after {i}") for i in range(30)])
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        assert {r.group for r in results} == {"gb"}
        on_gb = {r.message_id for r in warm + results if r.group == "gb"}
        assert {d.id for d in drain(subscription, len(on_gb))} == on_gb


def test_a_hung_meta_server_holds_a_send_only_until_the_next_one_is_asked(processes, tmp_path, pg_url) -> None:
    """Of `A,B`, A hangs (it accepts the connection, nothing answers): a send that needs a route waits
    META_NEXT_AFTER_S for A, then asks B; not the whole wait of a lone meta server."""
    with fresh_database(pg_url) as url:
        (hung, hung_port), (_, port) = (start_meta_on(processes, url, name=f"meta{i}") for i in (1, 2))
        metas = f"{HOST}:{hung_port},{HOST}:{port}"
        broker = start_broker(processes, tmp_path / "b", "--meta", metas, "--group", "gh", name="b")
        wait_until(lambda: registered_groups(f"{HOST}:{port}") == {"gh"}, "the broker registered")
        wait_role(broker, "master")  # registered is not yet told: a pending broker refuses the send
        os.kill(hung.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with Client(meta=metas) as client:  # new: it asks A for the route first
                [result] = client.send([OutgoingMessage("hung.meta", "x")])
            took = time.monotonic() - started
        finally:
            os.kill(hung.pid, signal.SIGCONT)
    assert result.ok, result.error
    assert took < META_TIMEOUT_S, f"the send waited {took:.1f} s, as for a lone meta server"


def test_meta_server_unreachable_or_without_brokers(processes, tmp_path) -> None:
    dead = f"{HOST}:{free_port()}"
    with Client(meta=dead, delivery_timeout_s=0.5) as client:
        started = time.monotonic()
        [result] = client.send([OutgoingMessage("s", "x")])
        assert time.monotonic() - started >= 0.5  # it asked again until its delivery timeout
        assert not result.ok and f"not stored within 0.5 s; cannot reach the meta server at {dead}" in result.error
        with pytest.raises(MetaUnreachable, match="cannot reach the meta server"):
            client.subscribe("s", "g")
    meta = start_meta(processes, tmp_path)
    with Client(meta=meta, delivery_timeout_s=0) as client:
        [result] = client.send([OutgoingMessage("s", "x")])
        assert not result.ok and result.error == "no writable broker group carries subject 's'"
        with pytest.raises(NoRoute, match="no broker group carries subject 's'"):
            client.subscribe("s", "g")


def test_closing_a_client_ends_a_send_waiting_for_a_broker(processes, tmp_path, brokers, caplog) -> None:
    """A send waiting out its delivery timeout (no broker yet) ends when its client is closed, with an
    error saying so, and a closed client fails a send at once: nothing more goes through it."""
    meta = start_meta(processes, tmp_path)
    client = Client(meta=meta, delivery_timeout_s=120)
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(client.send, [OutgoingMessage("nobody.home", "x")])
        wait_until(lambda: "no writable broker group known for nobody.home now" in caplog.text, "the send waiting")
        client.close()
        [result] = sending.result(timeout=60)  # not the 120 s of its delivery timeout
    assert not result.ok and result.error_code == ErrorCode.UNAVAILABLE
    assert "this client was closed" in result.error, result.error
    started = time.monotonic()
    [again] = client.send([OutgoingMessage("nobody.home", "y")])
    assert not again.ok and "this client was closed" in again.error, again.error
    assert time.monotonic() - started < 60  # at once, not after the delivery timeout
    with Client(brokers=[b.address for b in brokers]) as closed:  # two groups: sent in parallel
        assert all(r.ok for r in closed.send([OutgoingMessage("s", f"before close {i}") for i in range(20)]))
    results = closed.send([OutgoingMessage("s", f"after close {i}") for i in range(20)])
    assert all(not r.ok and "this client was closed" in r.error for r in results), results[0]


def test_the_async_client_waits_for_a_broker_too_and_closing_it_ends_a_send(processes, tmp_path, caplog) -> None:
    meta = start_meta(processes, tmp_path)

    async def logged(text: str) -> None:
        """Until the client logs `text` (the log line is the event: there is no hook to await)."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while text not in caplog.text:
            assert time.monotonic() < deadline, f"no log line {text!r}"
            await asyncio.sleep(0.05)

    async def main() -> tuple[Any, Any]:
        closing = AsyncClient(meta=meta, delivery_timeout_s=120)
        waiting = asyncio.ensure_future(closing.send([OutgoingMessage("nobody.async", "x")]))
        await logged("no writable broker group known for nobody.async now")
        await closing.close()
        [ended] = await asyncio.wait_for(waiting, 60)  # not the 120 s of its delivery timeout
        async with AsyncClient(meta=meta, delivery_timeout_s=120) as client:
            sending = asyncio.ensure_future(client.send([OutgoingMessage("late.async", "x")]))
            await logged("no writable broker group known for late.async now")
            await asyncio.to_thread(start_broker, processes, tmp_path / "late", "--meta", meta, "--group", "late")
            [joined] = await asyncio.wait_for(sending, 60)
        return ended, joined

    ended, joined = asyncio.run(main())
    assert not ended.ok and "this client was closed" in ended.error, ended.error
    assert joined.ok and joined.group == "late", joined.error


def test_a_send_waits_for_a_broker_that_joins_within_its_delivery_timeout(processes, tmp_path, caplog) -> None:
    """Kafka's delivery.timeout.ms: a send finding no broker for its subject (none yet, or a
    failover) asks the meta server again until its delivery timeout, instead of failing at once."""
    meta = start_meta(processes, tmp_path)
    with Client(meta=meta, delivery_timeout_s=60) as client, ThreadPoolExecutor(1) as pool:
        sending = pool.submit(client.send, [OutgoingMessage("late.joiner", "x")])
        wait_until(lambda: "no writable broker group known for late.joiner now" in caplog.text, "the send waiting")
        assert not sending.done()
        start_broker(processes, tmp_path / "late", "--meta", meta, "--group", "late", name="late")
        [result] = sending.result(timeout=60)
        assert result.ok and result.group == "late", result.error
        with client.subscribe("late.joiner", "g", start="earliest") as subscription:
            assert [d.id for d in drain(subscription, 1)] == [result.message_id]


# ---- the command line --------------------------------------------------------------------------------


def qmq(
    *args: str, input: bytes | None = None, env: dict | None = None, timeout: float = CLI_TIMEOUT_S
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qmq", *args],
        input=input,
        capture_output=True,
        env={**os.environ, **ENV, **(env or {})},
        timeout=timeout,
    )


def broker_args(brokers: list[Broker]) -> list[str]:
    return [arg for b in brokers for arg in ("--broker", b.address)]


def test_cli_send_then_tail(brokers) -> None:
    sent = qmq(
        "send",
        "cli.subject",
        "hello",
        *broker_args(brokers),
        "--count",
        "5",
        "--tag",
        "t1",
        "--key",
        "k",
        "--header",
        "h=v",
    )
    assert sent.returncode == 0, sent.stderr.decode()
    ids = sent.stdout.decode().split()
    assert len(ids) == 5 and len(set(ids)) == 5
    json_sent = qmq("send", "cli.subject", '{"a": [1, 2]}', "--json", *broker_args(brokers))
    bytes_sent = qmq("send", "cli.subject", *broker_args(brokers), "--size", "16")
    stdin_sent = qmq("send", "cli.subject", *broker_args(brokers), input=b"from stdin\n")
    for result in (json_sent, bytes_sent, stdin_sent):
        assert result.returncode == 0, result.stderr.decode()

    tail = qmq("tail", "cli.subject", "--group", "cli", *broker_args(brokers), "--from", "earliest", "--count", "8")
    assert tail.returncode == 0, tail.stderr.decode()
    lines = [json.loads(line) for line in tail.stdout.decode().splitlines()]
    by_id = {line["id"]: line for line in lines}
    assert len(lines) == 8 and set(ids) <= set(by_id)
    hello = by_id[ids[0]]
    assert {k: hello[k] for k in ("subject", "body", "content_type", "tags", "key", "headers", "attempts")} == {
        "subject": "cli.subject",
        "body": "hello",
        "content_type": "text/plain; charset=utf-8",
        "tags": ["t1"],
        "key": "k",
        "headers": {"h": "v"},
        "attempts": 1,
    }
    assert hello["created_at"].endswith("Z") and hello["stored_at"].endswith("Z")
    assert by_id[json_sent.stdout.decode().strip()]["body"] == {"a": [1, 2]}
    raw = by_id[bytes_sent.stdout.decode().strip()]
    assert raw["body_encoding"] == "base64" and len(raw["body"]) == 24
    assert by_id[stdin_sent.stdout.decode().strip()]["body"] == "from stdin\n"

    # Acknowledged: the group has nothing left; --timeout ends the wait.
    assert unfinished(brokers, "cli.subject", "cli") == 0
    started = time.monotonic()
    empty = qmq("tail", "cli.subject", "--group", "cli", *broker_args(brokers), "--timeout", "1")
    assert empty.returncode == 0 and empty.stdout == b"", empty.stderr.decode()
    assert time.monotonic() - started < 60  # ended by --timeout 1 (not a speed check: CI machines are loaded)


def test_cli_send_rides_through_a_broker_restart_within_its_delivery_timeout(processes, tmp_path) -> None:
    address = f"{HOST}:{free_port()}"  # nothing listens there yet
    quick = qmq("send", "cli.late", "x", "--broker", address, "--delivery-timeout", "0.5")
    assert quick.returncode == 1 and b"not stored within 0.5 s (" in quick.stderr, quick.stderr.decode()
    sender = subprocess.Popen(
        [sys.executable, "-m", "qmq", "send", "cli.late", "hello", "--broker", address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **ENV},
    )
    try:
        assert b"offering its messages again" in sender.stderr.readline()  # it met the closed port
        start_broker(processes, tmp_path / "late", port=int(address.rsplit(":", 1)[1]), name="late")
        out, err = sender.communicate(timeout=CLI_TIMEOUT_S)
    finally:
        sender.kill()
    assert sender.returncode == 0, err.decode()
    [sent_id] = out.decode().split()
    with Client(brokers=[address]) as client, client.subscribe("cli.late", "g", start="earliest") as subscription:
        assert [d.id for d in drain(subscription, 1)] == [sent_id]


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_cli_tail_from_latest_until_stopped(processes, brokers, stop) -> None:
    args = ["-m", "qmq", "tail", "cli.live", "--group", "live", *broker_args(brokers)]
    tail = processes.start(args, name="tail", env=ENV, stdout=subprocess.PIPE)
    wait_until(lambda: b"waiting for messages" in tail.log_path.read_bytes(), "tail registered with the brokers")
    sent = qmq("send", "cli.live", "now", *broker_args(brokers))
    assert sent.returncode == 0, sent.stderr.decode()
    line = json.loads(tail.stdout.readline())
    assert (line["id"], line["body"]) == (sent.stdout.decode().strip(), "now")
    os.killpg(tail.pid, stop)
    assert tail.wait(timeout=CLI_TIMEOUT_S) == 0
    # Stopping flushed the acknowledgement: nothing is left for the group.
    assert unfinished(brokers, "cli.live", "live") == 0
    again = qmq("tail", "cli.live", "--group", "live", *broker_args(brokers), "--timeout", "0.5")
    assert again.returncode == 0 and again.stdout == b"", again.stderr.decode()


def test_cli_errors_are_named(processes, brokers, tmp_path) -> None:
    dead = f"{HOST}:{free_port()}"
    result = qmq("send", "s", "x", "--meta", dead, "--delivery-timeout", "0")
    assert result.returncode != 0 and f"cannot reach the meta server at {dead}" in result.stderr.decode()
    result = qmq("send", "s", "x", "--delivery-timeout", "0", env={"QMQ_META": dead})  # QMQ_META stands in for --meta
    assert result.returncode != 0 and f"cannot reach the meta server at {dead}" in result.stderr.decode()
    result = qmq("tail", "s", "--group", "g", "--meta", dead, "--timeout", "1")
    assert result.returncode != 0 and f"cannot reach the meta server at {dead}" in result.stderr.decode()

    result = qmq("send", "s", "x", "--delay", "5", *broker_args(brokers))
    assert result.returncode != 0 and "no delay server is available" in result.stderr.decode()  # brokers only
    result = qmq("send", "s", "x", "--at", "2030-01-01T00:00:00Z", *broker_args(brokers))
    assert result.returncode != 0 and "delay server" in result.stderr.decode()
    assert (
        qmq("tail", "s", "--group", "g", "--from", "earliest", *broker_args(brokers), "--timeout", "0.5").stdout == b""
    )  # nothing was sent early

    result = qmq("send", "s", *broker_args(brokers), "--size", str(MAX_MESSAGE_BYTES + 1))
    assert result.returncode != 0 and result.stdout == b""
    assert "MESSAGE_TOO_LARGE" in result.stderr.decode() and "was not sent" in result.stderr.decode()

    result = qmq("send", "bad subject", "x", *broker_args(brokers))
    assert result.returncode != 0 and "subject 'bad subject'" in result.stderr.decode()

    meta = start_meta(processes, tmp_path)
    result = qmq("send", "s", "x", "--meta", meta, "--delivery-timeout", "0")
    assert result.returncode != 0 and "no broker group carries subject 's'" in result.stderr.decode()
    result = qmq("send", "s", "x", "--meta", meta, "--delivery-timeout", "0.5")  # said at once, then waited for
    err = result.stderr.decode()
    assert result.returncode != 0 and "no broker group carries subject 's'" in err.splitlines()[0], err
    assert "waiting up to 0.5 s for one (--delivery-timeout)" in err.splitlines()[0], err
    assert "not stored within 0.5 s; no writable broker group carries subject 's'" in err, err
