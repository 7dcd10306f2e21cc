"""The worker's parts on their own: the retry policy, capacity credit, liveness, the time limit,
hooks, app declarations, and the chain of steps around a handler against real SQLite and PostgreSQL
databases (idempotency records, rollbacks, the purge)."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa

import qmq
from qmq.db.engine import create_engine
from qmq.db.migrate import upgrade
from tests.support.databases import sqlite_or_postgres
from tests.test_meta import wait_until
from worker.app import App
from worker.capacity import Capacity
from worker.errors import TimeLimitExceeded
from worker.liveness import Liveness, broadcast_group_key
from worker.loading import AppNotFound, load_app
from worker.message import Message
from worker.outcome import Kind
from worker.pipeline import inner_chain
from worker.retry_policy import RetryPolicy
from worker.runner import expand_hostname, select_consumers
from worker.schema import consumed
from worker.steps.idempotency import purge_consumed, record_consumed
from worker.steps.step import Call
from worker.steps.time_limit import time_limit_step

# ---- retry policy ----------------------------------------------------------------------------------


def failing(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_backoff_doubles_from_5_s_to_an_hour_and_jitter_stays_in_the_upper_half() -> None:
    plain = RetryPolicy(jitter=False)
    assert [plain.backoff(n) for n in (1, 2, 3, 4)] == [5.0, 10.0, 20.0, 40.0]
    assert plain.backoff(12) == 3600.0 and plain.backoff(500) == 3600.0
    rng = random.Random(7)
    jittered = [RetryPolicy().backoff(3, rng) for _ in range(500)]
    assert all(10.0 <= d <= 20.0 for d in jittered) and max(jittered) - min(jittered) > 5


def test_decisions() -> None:
    policy = RetryPolicy(
        max_retries=2, jitter=False, autoretry_for=(OSError, ValueError), dont_autoretry_for=(FileNotFoundError,)
    )
    retry = policy.decide(failing(OSError("disk")), 1)
    assert (retry.kind, retry.delay_s) == (Kind.RETRY, 5.0)
    assert retry.reason.startswith("OSError: disk (at ") and "in failing" in retry.reason
    assert policy.decide(failing(ValueError("x")), 2).delay_s == 10.0
    exhausted = policy.decide(failing(ValueError("x")), 3)
    assert exhausted.kind is Kind.DEAD and exhausted.reason.startswith("gave up after 3 attempts: ValueError: x")
    assert policy.decide(failing(KeyError("k")), 1).kind is Kind.DEAD  # not in autoretry_for
    assert policy.decide(failing(FileNotFoundError("f")), 1).kind is Kind.DEAD  # in dont_autoretry_for
    asked = policy.decide(failing(qmq.Retry(delay=42)), 1)
    assert (asked.kind, asked.delay_s) == (Kind.RETRY, 42)
    assert policy.decide(failing(qmq.Retry()), 2).delay_s == 10.0  # no delay: the backoff
    assert policy.decide(failing(qmq.Retry(delay=1)), 3).kind is Kind.DEAD  # counts against max_retries
    rejected = policy.decide(failing(qmq.Reject("no such order")), 1)
    assert (rejected.kind, rejected.reason) == (Kind.DEAD, "no such order")
    assert RetryPolicy(max_retries=None).max_attempts == 1_000_000 and policy.max_attempts == 3
    assert not RetryPolicy(max_retries=None).exhausted(10**9)
    with pytest.raises(ValueError):
        qmq.Retry(delay=-1)
    with pytest.raises(ValueError):
        RetryPolicy(max_retries=-1)


# ---- capacity and liveness ---------------------------------------------------------------------------


def test_capacity_pulls_only_for_free_slots() -> None:
    capacity = Capacity(concurrency=2, prefetch_multiplier=4)
    assert capacity.reserve(0) == 8  # idle: the whole window
    capacity.received(8, 3)  # the pull brought 3
    assert capacity.reserve(0) == 5  # credit 8 - 3 queued: at least half the window, worth a pull
    capacity.received(5, 5)
    assert capacity.reserve(0) == 0  # 8 queued: nothing more
    capacity.started()
    capacity.started()  # both slots busy, 6 queued: credit (2 - 2) * 4 - 6 < 0
    for _ in range(6):
        capacity.finished()
        capacity.started()
    assert capacity.reserve(0) == 0  # two long handlers running, nothing else held: still no pull
    capacity.finished()  # one slot free: 4 messages' worth
    assert capacity.reserve(0) == 4
    capacity.stop()
    assert capacity.reserve(5) == 0  # stopped: no wait, no pull


def test_capacity_shares_the_window_between_consumers_and_wakes_a_waiting_feeder() -> None:
    capacity = Capacity(concurrency=4, prefetch_multiplier=4, consumers=3)
    assert capacity.reserve(0) == 5  # 16 // 3: three shares fit in the window
    assert capacity.reserve(0) == 5
    capacity.received(10, 10)
    assert capacity.reserve(0) == 5  # credit 6: a share is worth a pull
    capacity.received(5, 5)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(capacity.reserve(10)))
    waiter.start()
    for _ in range(15):
        capacity.started()
        capacity.finished()
    waiter.join(10)
    assert got == [5]


def test_capacity_lets_every_consumer_of_an_idle_worker_long_poll_and_none_is_overtaken() -> None:
    capacity = Capacity(concurrency=4, prefetch_multiplier=16, consumers=4)  # the demo's worker
    assert [capacity.reserve(0) for _ in range(4)] == [16] * 4  # all four poll at once
    for _ in range(3):  # one poll comes back empty and polls again: the others keep theirs
        capacity.received(16, 0)
        assert capacity.reserve(0) == 16

    tiny = Capacity(concurrency=1, prefetch_multiplier=1, consumers=2)  # fewer credits than consumers
    assert tiny.reserve(0) == 1
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(tiny.reserve(10)))
    waiter.start()
    wait_until(lambda: tiny.waiting == 1, "the second feeder waits for credit")
    tiny.received(1, 0)  # the first poll came back empty...
    assert tiny.reserve(0) == 0  # ...and its feeder asks again: the one waiting goes first
    waiter.join(10)
    assert got == [1]


def test_liveness() -> None:
    liveness = Liveness(timeout_s=10, now=100.0)
    assert liveness.check(500.0, held=0, backlog=0, problems=[])  # idle for ages: healthy
    assert liveness.check(505.0, held=3, backlog=None, problems=[])  # work appeared 5 s ago
    assert not liveness.check(511.0, held=3, backlog=None, problems=[])
    assert "no message finished for 11 s while 3 are held" in liveness.reason
    liveness.progress(512.0)
    assert liveness.check(513.0, held=0, backlog=40, problems=[])
    assert not liveness.check(523.0, held=0, backlog=40, problems=[])  # a backlog at the brokers, no progress
    liveness.progress(523.0)
    assert not liveness.check(524.0, held=0, backlog=0, problems=[("cannot subscribe: meta away", 510.0)])
    assert "cannot subscribe: meta away (for 14 s)" in liveness.reason
    assert broadcast_group_key("g", "c1") == "g.bc-" + __import__("hashlib").sha1(b"c1").hexdigest()[:12]


# ---- the time limit ------------------------------------------------------------------------------------


def make_app(**kwargs) -> App:
    return App("units", brokers=["127.0.0.1:1"], **kwargs)


def call_for(consumer, attempts: int = 1, message_id: str | None = None) -> Call:
    message = Message(
        message_id or str(uuid.uuid4()),
        consumer.subject,
        consumer.group,
        {},
        "application/json",
        (),
        None,
        {},
        attempts,
        None,
        None,
    )
    return Call(message, consumer)


def test_time_limit_interrupts_a_busy_handler_and_never_leaks_afterwards() -> None:
    app = make_app()

    @app.consumer("spin", time_limit=0.2)
    def spin(message) -> None:
        while True:
            pass

    consumer = app.consumers[0]
    started = time.monotonic()
    with pytest.raises(TimeLimitExceeded, match=r"spin/units ran longer than its time limit of 0\.2 s"):
        time_limit_step(call_for(consumer), lambda call: spin(call.message))
    assert time.monotonic() - started < 5

    @app.consumer("brief", time_limit=0.05)
    def brief(message) -> None:
        time.sleep(0.049)

    for _ in range(30):  # handlers finishing around their deadline leave nothing pending behind them
        # Firing in time is fine; what must not happen is an exception after the step returned.
        with contextlib.suppress(TimeLimitExceeded):
            time_limit_step(call_for(app.consumers[1]), lambda call: brief(call.message))
        time.sleep(0.01)


# ---- hooks and declarations ----------------------------------------------------------------------------


def test_a_failing_hook_is_logged_and_changes_nothing(caplog) -> None:
    app = make_app()
    seen = []

    @app.consumer("s")
    def handle(message) -> None:
        seen.append("handler")

    @app.on("before_message")
    def broken(message) -> None:
        raise RuntimeError("hook bug")

    app.on("after_message")(lambda message, outcome: seen.append(outcome.kind))
    with caplog.at_level(logging.ERROR, logger="qmq.worker"):
        outcome = inner_chain(app.consumers[0])(call_for(app.consumers[0]))
    assert outcome.kind is Kind.ACK and seen == ["handler", Kind.ACK]
    assert "hook before_message" in caplog.text and "hook bug" in caplog.text
    with pytest.raises(ValueError, match="unknown hook"):
        app.on("task_prerun")


def test_declarations_are_checked() -> None:
    app = make_app()
    with pytest.raises(ValueError, match="needs the app's database"):
        app.consumer("s", idempotent=True)
    with pytest.raises(ValueError, match="needs App"):
        app.consumer("s", idempotent="redis")
    with pytest.raises(ValueError, match="group"):
        app.consumer("s", group="bad group!")
    with pytest.raises(ValueError, match="takes a session"):
        app.consumer("s")(lambda message, session: None)
    app.consumer("s")(lambda message: None)
    with pytest.raises(ValueError, match="already has a consumer"):
        app.consumer("s")
    assert select_consumers(app, []) == app.consumers
    with pytest.raises(ValueError, match="no consumer in app 'units' for other"):
        select_consumers(app, ["other"])
    with pytest.raises(ValueError, match="broadcast"):
        make_app(db="sqlite://").consumer("b", broadcast=True, idempotent=True)
    name = expand_hostname("w1@%h/%p")
    assert name.startswith("w1@") and "/" not in name and name.endswith(str(__import__("os").getpid()))


def test_load_app_errors() -> None:
    with pytest.raises(AppNotFound, match=r"cannot import 'tests\.apps\.nowhere'"):
        load_app("tests.apps.nowhere:app")
    with pytest.raises(AppNotFound, match="has no attribute 'nothing'"):
        load_app("tests.apps:nothing")
    with pytest.raises(AppNotFound, match=r"not a qmq\.App"):
        load_app("tests.apps:__doc__")


# ---- the chain around a handler on a real database -------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    with sqlite_or_postgres(request.param, request, tmp_path, "worker.sqlite3") as url:
        upgrade(url)
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE orders (message_id VARCHAR(64) NOT NULL, n INTEGER NOT NULL)"))
        engine.dispose()
        yield url


def test_idempotent_chain_commits_record_and_writes_together(db_url) -> None:
    app = make_app(db=db_url)
    failures = {"bad": 1}

    @app.consumer("orders", group="billing", idempotent=True, max_retries=3, retry_jitter=False)
    def handle(message, session) -> None:
        session.execute(sa.text("INSERT INTO orders VALUES (:id, 1)"), {"id": message.id})
        if failures.get(message.id, 0) >= message.attempts:
            raise RuntimeError("after writing")

    chain = inner_chain(app.consumers[0])
    consumer = app.consumers[0]
    assert chain(call_for(consumer, message_id="m1")).kind is Kind.ACK
    assert chain(call_for(consumer, message_id="m1")).kind is Kind.DUPLICATE  # the handler is skipped
    failed = chain(call_for(consumer, message_id="bad"))
    assert failed.kind is Kind.RETRY and "RuntimeError: after writing" in failed.reason
    assert chain(call_for(consumer, attempts=2, message_id="bad")).kind is Kind.ACK
    with app.engine.connect() as conn:
        assert sorted(conn.execute(sa.text("SELECT message_id FROM orders")).scalars()) == ["bad", "m1"]
        records = conn.execute(sa.select(consumed.c.consumer_group, consumed.c.message_id, consumed.c.subject))
        assert sorted(records) == [("billing", "bad", "orders"), ("billing", "m1", "orders")]
        # Another group's record is its own.
        assert record_consumed(conn, "audit", "m1", "orders") and not record_consumed(conn, "audit", "m1", "orders")
        conn.rollback()
    app.engine.dispose()


def test_purge_removes_records_past_the_window_only(db_url) -> None:
    engine = create_engine(db_url)
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(
            consumed.insert(),
            [
                {"consumer_group": "g", "message_id": f"old{i}", "subject": "s", "consumed_at": now - timedelta(days=8)}
                for i in range(7)
            ]
            + [{"consumer_group": "g", "message_id": "new", "subject": "s", "consumed_at": now - timedelta(days=1)}],
        )
    assert purge_consumed(engine, timedelta(days=7), batch=3) == 7
    with engine.connect() as conn:
        assert conn.execute(sa.select(consumed.c.message_id)).scalars().all() == ["new"]
    engine.dispose()


def test_redis_idempotency_lease_done_and_release(redis_client, redis_prefix) -> None:
    app = make_app(redis="redis://127.0.0.1:6379/0", redis_prefix=f"{redis_prefix}units:")
    entered, release = threading.Event(), threading.Event()

    @app.consumer("mail", group="mailer", idempotent="redis", time_limit=5, max_retries=3)
    def send_mail(message) -> None:
        if message.body.get("block"):
            entered.set()
            release.wait(10)
        if message.body.get("fail"):
            raise OSError("smtp down")

    consumer = app.consumers[0]
    chain = inner_chain(consumer)
    key = f"{redis_prefix}units:consumed:mailer:m1"

    def call(message_id: str, body: dict, attempts: int = 1) -> Call:
        return Call(
            Message(message_id, "mail", "mailer", body, "application/json", (), None, {}, attempts, None, None),
            consumer,
        )

    first: list = []
    runner = threading.Thread(target=lambda: first.append(chain(call("m1", {"block": True}))))
    runner.start()
    assert entered.wait(10)
    busy = chain(call("m1", {}))  # the same message, delivered again while the first is at work
    assert busy.kind is Kind.RETRY and busy.reason == "another delivery holds the lease"
    assert 30 < busy.delay_s <= 36  # when the lease (time limit + 30 s) runs out
    release.set()
    runner.join(10)
    assert first[0].kind is Kind.ACK
    assert redis_client.get(key) == b"done"
    assert chain(call("m1", {})).kind is Kind.DUPLICATE

    failed = chain(call("m2", {"fail": True}))
    assert failed.kind is Kind.RETRY and "OSError: smtp down" in failed.reason
    assert redis_client.get(f"{redis_prefix}units:consumed:mailer:m2") is None  # released for the retry
    assert chain(call("m2", {}, attempts=2)).kind is Kind.ACK
    app.redis.close()
