"""`qmq worker` as a real process against real `qmq broker` processes, PostgreSQL and Redis: warm
shutdown under load, a SIGKILLed worker's messages taken over with idempotency, retries and dead
letters, four workers sharing a backlog, broadcast, a broker restarted under a running worker, cold
shutdown, pool processes (time limit, a pool process that dies), liveness on /healthz, a worker that
comes up before its meta server, and command-line errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.support.broker import ROOT, RawConsumer, restart_broker, start_broker
from tests.support.databases import fresh_database
from tests.support.processes import free_port
from tests.support.worker import (
    EXIT_TIMEOUT_S,
    GROUP,
    SUBJECT,
    TABLES,
    app_database,
    dead_letters,
    group_totals,
    handled,
    handled_count,
    http_get,
    log_text,
    metric,
    query,
    query_autocommit,
    send_bodies,
    start_worker,
    wait_for,
    wait_ready,
)
from tests.test_meta import start_meta


@pytest.fixture
def db_url(pg_url):
    with app_database(pg_url) as url:
        yield url


@pytest.fixture
def broker(processes, tmp_path):
    # A short consumer timeout: a dead worker's messages go to the others within seconds.
    return start_broker(processes, tmp_path / "broker", "--consumer-timeout", "2")


def test_sigterm_during_a_burst_finishes_acks_and_exits_0(processes, broker, db_url) -> None:
    ids = send_bodies([broker], [{"sleep": 0.01}] * 300)
    first = start_worker(processes, [broker], db_url, "-c", "4", name="first")
    wait_for(lambda: handled_count(db_url) >= 50, "50 messages handled")
    first.send_signal(signal.SIGTERM)
    assert first.wait(EXIT_TIMEOUT_S) == 0, log_text(first)
    assert "warm shutdown complete" in log_text(first)

    done = handled(db_url)
    assert len(done) < len(ids), "the burst was over before the SIGTERM: nothing was tested"
    assert len({row[0] for row in done}) == len(done)  # none twice
    # Everything the worker was handed was handled and acknowledged: the broker has none out.
    assert group_totals([broker])["in_flight"] == 0

    second = start_worker(processes, [broker], db_url, "-c", "4", name="second")
    wait_for(lambda: handled_count(db_url) >= len(ids), "every message handled")
    wait_for(lambda: group_totals([broker])["backlog"] + group_totals([broker])["in_flight"] == 0, "all acked")
    second.send_signal(signal.SIGTERM)
    assert second.wait(EXIT_TIMEOUT_S) == 0
    rows = handled(db_url)
    assert Counter(row[0] for row in rows) == Counter(ids)  # each exactly once, over both workers


def test_sigkilled_worker_is_taken_over_and_idempotency_keeps_one_row_per_message(processes, broker, db_url) -> None:
    env = {"QMQ_TEST_IDEMPOTENT": "sql"}
    ids = send_bodies([broker], [{"sleep": 0.02}] * 300)
    # Five messages sent again with the same ids: deliveries that certainly repeat.
    send_bodies([broker], [{"sleep": 0.02}] * 5, ids=ids[:5])
    victim = start_worker(processes, [broker], db_url, "-c", "4", name="victim", env=env)
    wait_for(lambda: handled_count(db_url) >= 60, "60 messages handled")
    processes.kill(victim)  # SIGKILL: committed messages whose acks were not yet flushed come again
    start_worker(
        processes, [broker], db_url, "-c", "4", "--metrics-port", str(port := free_port()), name="survivor", env=env
    )
    wait_for(lambda: len({row[0] for row in handled(db_url)}) == len(ids), "every message handled")
    wait_for(lambda: group_totals([broker])["backlog"] + group_totals([broker])["in_flight"] == 0, "all acked")

    rows = handled(db_url)
    assert Counter(row[0] for row in rows) == Counter(ids)  # exactly one business row per message id
    assert {row[2] for row in rows} == {"victim", "survivor"}
    assert metric(port, "qmq_worker_messages_duplicate_total") >= 5  # the repeats were skipped, and acked
    consumed = query(db_url, "SELECT message_id FROM qmq_consumed WHERE consumer_group = 'recorder'")
    assert sorted(r[0] for r in consumed) == sorted(ids)


def test_retries_backoff_retry_delay_and_dead_letters(processes, broker, db_url) -> None:
    worker = start_worker(processes, [broker], db_url, "-c", "4", name="w", env={"QMQ_TEST_MAX_RETRIES": "2"})
    flaky, doomed, later, rejected = send_bodies(
        [broker], [{"fail_times": 2}, {"always_fail": True}, {"retry_delay": 2.0}, {"reject": "bad order data"}]
    )
    wait_for(lambda: {flaky, later} <= {row[0] for row in handled(db_url)}, "the flaky and delayed ones handled")
    by_id = {row[0]: row for row in handled(db_url)}
    assert by_id[flaky][1] == 3  # failed twice, then succeeded on its third attempt
    assert by_id[later][1] == 2

    # qmq.Retry(delay=2): the second attempt came 2 s after the first, within a second.
    first, second = (
        r[0] for r in query(db_url, "SELECT at FROM worker_attempts WHERE message_id = %s ORDER BY at", later)
    )
    assert 1.95 <= (second - first).total_seconds() <= 3.0

    dead = {
        m["id"]: m
        for m in wait_for(lambda: len(dead_letters(broker)) == 2 and dead_letters(broker), "two dead letters")
    }
    assert set(dead) == {doomed, rejected}
    assert dead[doomed]["attempt"] == 3  # max_retries=2: three attempts, then dead
    assert "ValueError: this message always fails" in dead[doomed]["reason"]
    assert dead[rejected]["attempt"] == 1 and dead[rejected]["reason"] == "bad order data"
    attempts = Counter(r[0] for r in query(db_url, "SELECT message_id FROM worker_attempts"))
    assert attempts[doomed] == 3 and attempts[rejected] == 1 and attempts[flaky] == 3
    assert doomed not in {row[0] for row in handled(db_url)}  # its transactions were rolled back
    totals = wait_for(lambda: (t := group_totals([broker]))["in_flight"] == 0 and t, "nothing left in flight")
    assert totals["dead"] == 2 and totals["backlog"] == 0 and totals["retrying"] == 0
    # A deliberate qmq.Reject is one line at WARNING, without a traceback (issue 15, case 6).
    log = log_text(worker)
    assert f"WARNING work/recorder {rejected} attempt 1 rejected, dead-lettered: bad order data" in log
    assert "raise qmq.Reject" not in log and "this message always fails" in log


def test_a_new_group_starts_at_the_earliest_message_unless_told_latest(processes, broker, db_url) -> None:
    """Issue 15, case 4: what was committed before a group's first worker ran is consumed; `qmq
    worker --from latest` opts out (for groups new to the broker)."""
    before = send_bodies([broker], [{"n": 1}, {"n": 2}])
    start_worker(processes, [broker], db_url, name="first")
    wait_for(lambda: sorted(r[0] for r in handled(db_url)) == sorted(before), "the messages sent before it ran")
    start_worker(processes, [broker], db_url, "--from", "latest", name="late", env={"QMQ_TEST_GROUP": "late"})
    [after] = send_bodies([broker], [{"n": 3}])
    wait_for(lambda: [r[0] for r in handled(db_url) if r[2] == "late"] == [after], "the late group's one message")
    wait_for(lambda: after in {r[0] for r in handled(db_url) if r[2] == "first"}, "the first group has it too")


def test_a_worker_without_its_tables_refuses_to_start(processes, broker, pg_url) -> None:
    """Issue 15, case 5: no "ready" and a failure per message, but a clear error at start."""
    with fresh_database(pg_url) as url:
        query_autocommit(url, TABLES)  # the app's own tables only: qmq's were never created
        worker = start_worker(processes, [broker], url, name="w", env={"QMQ_TEST_IDEMPOTENT": "sql"}, ready=False)
        assert worker.wait(EXIT_TIMEOUT_S) == 1
    log = log_text(worker)
    assert "qmq_consumed does not exist" in log and "qmq db upgrade --db" in log and "manage.py migrate" in log
    assert " ready" not in log and "Traceback" not in log


def test_every_consumer_of_an_idle_worker_keeps_pulling_its_retries(processes, broker, db_url) -> None:
    # Four consumers share the worker's prefetch window (4 x 16). Once idle, each must keep a long poll
    # open: a consumer left without credit never sees its retries come due (the demo's lost e-mails).
    subjects = [SUBJECT, "quiet-1", "quiet-2", "quiet-3"]
    start_worker(processes, [broker], db_url, "-c", "4", name="w", env={"QMQ_TEST_ALSO": ",".join(subjects[1:])})
    for round_ in range(3):
        ids = [send_bodies([broker], [{"fail_times": 2}], subject=subject)[0] for subject in subjects]
        wait_for(
            lambda ids=ids: set(ids) <= {row[0] for row in handled(db_url)},
            f"round {round_}: all handled",
            timeout_s=20,
        )
    assert Counter(row[1] for row in handled(db_url)) == {3: 12}  # two failures, then done: each once


def test_four_workers_share_a_backlog(processes, broker, db_url) -> None:
    workers = [start_worker(processes, [broker], db_url, "-c", "2", name=f"w{i}", ready=False) for i in range(4)]
    for proc in workers:
        wait_ready(proc)
    ids = send_bodies([broker], [{"sleep": 0.02}] * 200)
    wait_for(lambda: handled_count(db_url) >= len(ids), "every message handled")
    rows = handled(db_url)
    assert Counter(row[0] for row in rows) == Counter(ids)
    per_worker = Counter(row[2] for row in rows)
    assert set(per_worker) == {"w0", "w1", "w2", "w3"}, per_worker  # every worker took a share


def test_a_busy_worker_is_served_ahead_no_more_than_its_credit(processes, tmp_path, db_url) -> None:
    # One slot, prefetch multiplier 4: while the slot runs a long handler the worker's pulls ask for
    # at most 4 - 1 more. The broker journals what comes meanwhile for the worker's next pull, up to
    # the room its last pull left (qmq/broker/ahead.py); the rest stays the group's.
    broker = start_broker(processes, tmp_path / "ahead", "--serve-ahead", "60", "--consumer-timeout", "600")
    start_worker(processes, [broker], db_url, "-c", "1", "--prefetch-multiplier", "4", name="busy")
    [long] = send_bodies([broker], [{"sleep": 8}])
    wait_for(lambda: query(db_url, "SELECT 1 FROM worker_attempts WHERE message_id = %s", long), "the slot is busy")
    [second] = send_bodies([broker], [{}])  # taken by the worker's next pull (asking for 3), or served ahead
    wait_for(lambda: group_totals([broker])["in_flight"] == 2, "the worker holds 2")
    # The worker is out of credit now and does not pull: only serving ahead gives it more, up to 2.
    rest = send_bodies([broker], [{}] * 4)
    raw = RawConsumer(broker.connect(client_id="raw"), SUBJECT, GROUP, "raw", {"start": "earliest"})
    got = raw.pull(wait_ms=0)
    assert not handled(db_url), "the long handler ended before the check: nothing was tested"
    assert [d.id for d in got] == rest[2:]
    raw.ack(got)
    wait_for(lambda: handled_count(db_url) == 4, "the worker handled what it was served")
    assert sorted(row[0] for row in handled(db_url)) == sorted([long, second, *rest[:2]])
    wait_for(lambda: group_totals([broker])["in_flight"] == 0, "all acked")


def test_broadcast_reaches_every_worker(processes, broker, db_url) -> None:
    names = ["b0", "b1", "b2"]
    workers = [
        start_worker(processes, [broker], db_url, "-c", "2", name=name, env={"QMQ_TEST_BROADCAST": "1"}, ready=False)
        for name in names
    ]
    for proc in workers:
        wait_ready(proc)
    ids = send_bodies([broker], [{}] * 20)
    wait_for(lambda: handled_count(db_url) >= len(ids) * len(names), "every worker handled every message")
    rows = handled(db_url)
    for name in names:
        assert sorted(row[0] for row in rows if row[2] == name) == sorted(ids)


def test_worker_keeps_consuming_across_a_broker_restart(processes, broker, db_url) -> None:
    worker = start_worker(processes, [broker], db_url, "-P", "solo", name="w", env={"QMQ_TEST_IDEMPOTENT": "sql"})
    before = send_bodies([broker], [{}] * 20)
    wait_for(lambda: handled_count(db_url) >= len(before), "the first messages handled")
    processes.kill(broker.proc)
    restarted = restart_broker(processes, broker)
    after = send_bodies([restarted], [{}] * 20)
    wait_for(lambda: handled_count(db_url) >= len(before) + len(after), "messages sent after the restart handled")
    assert Counter(row[0] for row in handled(db_url)) == Counter(before + after)
    assert worker.poll() is None
    worker.send_signal(signal.SIGTERM)  # the solo pool's warm shutdown, too
    assert worker.wait(EXIT_TIMEOUT_S) == 0


def test_redis_idempotency_skips_repeats(processes, broker, db_url, redis_client, redis_prefix) -> None:
    env = {
        "QMQ_TEST_IDEMPOTENT": "redis",
        "QMQ_TEST_REDIS": "redis://127.0.0.1:6379/0",
        "QMQ_TEST_REDIS_PREFIX": redis_prefix,
    }
    ids = send_bodies([broker], [{}] * 9 + [{"fail_times": 1}])
    send_bodies([broker], [{}] * 5, ids=ids[:5])  # the same ids again
    start_worker(processes, [broker], db_url, "-c", "4", name="w", env=env)
    wait_for(lambda: handled_count(db_url) >= len(ids), "every message handled")
    wait_for(lambda: group_totals([broker])["backlog"] + group_totals([broker])["in_flight"] == 0, "all acked")
    rows = handled(db_url)
    assert Counter(row[0] for row in rows) == Counter(ids)  # the five repeats were skipped
    assert {row[1] for row in rows if row[0] == ids[-1]} == {2}  # a failure released its lease: the retry ran
    for message_id in ids:
        assert redis_client.get(f"{redis_prefix}consumed:recorder:{message_id}") == b"done"
        assert redis_client.pttl(f"{redis_prefix}consumed:recorder:{message_id}") > 6 * 24 * 3600 * 1000


def test_second_sigint_is_a_cold_shutdown_and_the_message_comes_again(processes, broker, db_url) -> None:
    [message_id] = send_bodies([broker], [{"hang_in": "stuck"}])
    stuck = start_worker(processes, [broker], db_url, "-c", "1", name="stuck")
    wait_for(lambda: query(db_url, "SELECT 1 FROM worker_attempts"), "the handler started")
    stuck.send_signal(signal.SIGINT)
    wait_for(lambda: "warm shutdown: no more pulls" in log_text(stuck), "the warm shutdown began")
    assert stuck.poll() is None  # a warm shutdown waits for the handler
    stuck.send_signal(signal.SIGINT)
    assert stuck.wait(EXIT_TIMEOUT_S) == 128 + signal.SIGINT
    assert "cold shutdown" in log_text(stuck)

    start_worker(processes, [broker], db_url, "-c", "1", name="other")
    wait_for(lambda: handled(db_url), "the message handled by another worker")
    assert [row[0] for row in handled(db_url)] == [message_id]


# ---- pool processes, liveness, servers that come late, the command line --------------------------------


def pool_processes(pid: int) -> set[int]:
    """The pool processes of worker `pid` (multiprocessing's resource tracker is a child too)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.add(int(child))
    return found


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True


def test_process_pool_time_limit_lost_process_and_cold_shutdown(processes, broker, db_url) -> None:
    env = {"QMQ_TEST_TIME_LIMIT": "1", "QMQ_TEST_MAX_RETRIES": "1"}
    worker = start_worker(processes, [broker], db_url, "-P", "processes", "-c", "2", name="procs", env=env)
    pool = pool_processes(worker.pid)
    assert len(pool) == 2
    ids = send_bodies([broker], [{}] * 10 + [{"spin": 30}, {"die_first": True}])
    # Every id, not a count: with a 2 s consumer timeout a loaded machine may deliver a message twice
    # (at least once, no idempotency here), and a count would be reached before the slow ones came.
    wait_for(lambda: set(ids) <= {row[0] for row in handled(db_url)}, "every message handled")
    by_id = {row[0]: row for row in handled(db_url)}
    assert sorted(by_id) == sorted(ids)
    assert by_id[ids[-2]][1] == 2  # the time limit stopped attempt 1 in its pool process; attempt 2 ran
    assert by_id[ids[-1]][1] == 2  # its pool process died on attempt 1: retried, in a new process
    text = log_text(worker)
    assert "TimeLimitExceeded" in text and "died (exit code -9)" in text
    pool = pool_processes(worker.pid)
    assert len(pool) == 2  # the dead one was replaced

    [stuck] = send_bodies([broker], [{"hang_in": "procs"}])
    wait_for(lambda: query(db_url, "SELECT 1 FROM worker_attempts WHERE message_id = %s", stuck), "it started")
    worker.send_signal(signal.SIGQUIT)
    assert worker.wait(EXIT_TIMEOUT_S) == 128 + signal.SIGQUIT
    wait_for(lambda: all(gone(pid) for pid in pool), "the pool processes are gone")


def test_process_pool_warm_shutdown_stops_its_processes(processes, broker, db_url) -> None:
    worker = start_worker(processes, [broker], db_url, "-P", "processes", "-c", "1", name="warm")
    pool = pool_processes(worker.pid)
    ids = send_bodies([broker], [{"sleep": 0.05}] * 20)
    wait_for(lambda: len(handled(db_url)) >= 5, "some messages handled")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(EXIT_TIMEOUT_S) == 0, log_text(worker)
    assert all(gone(pid) for pid in pool)
    assert group_totals([broker])["in_flight"] == 0  # what it was handed, it handled and acked
    assert len({row[0] for row in handled(db_url)}) == len(handled(db_url)) <= len(ids)


def test_healthz_reports_a_worker_that_makes_no_progress(processes, broker, db_url) -> None:
    port = free_port()
    worker = start_worker(
        processes, [broker], db_url, "-c", "1", "--liveness-timeout", "2", "--metrics-port", str(port), name="live"
    )
    assert http_get(port, "/healthz") == (200, "ok\n")
    send_bodies([broker], [{}])
    wait_for(lambda: handled(db_url), "a message handled")
    send_bodies([broker], [{"hang_in": "live"}, {}, {}])
    _, reason = wait_for(lambda: (r := http_get(port, "/healthz"))[0] == 503 and r, "/healthz says 503")
    assert "no message finished for" in reason
    assert metric(port, "qmq_worker_healthy") == 0
    assert metric(port, "qmq_worker_messages_in_flight") >= 1
    assert http_get(port, "/nowhere")[0] == 404
    processes.kill(worker)  # its handler sleeps for ten minutes: no point in a warm shutdown


def test_worker_started_before_its_meta_server_and_broker_consumes_once_they_come(processes, tmp_path, db_url) -> None:
    meta_port = free_port()
    meta_address = f"127.0.0.1:{meta_port}"
    worker = start_worker(processes, [], db_url, "--meta", meta_address, "-c", "2", name="early", ready=False)
    wait_for(lambda: "cannot subscribe to work" in log_text(worker), "the worker tried and failed")
    start_meta(processes, f"sqlite:///{tmp_path / 'meta.sqlite3'}", port=meta_port)
    broker = start_broker(processes, tmp_path / "broker", "--meta", meta_address, "--group", "g1")
    wait_for(lambda: " ready: " in log_text(worker), "the worker subscribed")
    ids = send_bodies([broker], [{}] * 10)
    wait_for(lambda: len(handled(db_url)) >= len(ids), "every message handled")
    assert sorted(row[0] for row in handled(db_url)) == sorted(ids)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qmq", "worker", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "QMQ_META": "", "QMQ_TEST_DB": "sqlite://"},
        timeout=60,
    )


def test_command_line_errors_are_named() -> None:
    missing = run_cli("-A", "tests.apps.nowhere:app")
    assert missing.returncode == 2 and "cannot import 'tests.apps.nowhere'" in missing.stderr
    unknown = run_cli("-A", "tests.apps.recorder:app", "-Q", "orders,work", "--broker", "127.0.0.1:1")
    assert unknown.returncode == 2 and "no consumer in app 'recorder' for orders" in unknown.stderr


def test_sigusr1_to_a_pool_process_shows_its_handler_and_the_worker_goes_on(processes, broker, db_url) -> None:
    worker = start_worker(processes, [broker], db_url, "-P", "processes", "-c", "1", name="stacks")
    [slow] = send_bodies([broker], [{"sleep": 3}])
    wait_for(lambda: query(db_url, "SELECT 1 FROM worker_attempts WHERE message_id = %s", slow), "the handler runs")
    [child] = pool_processes(worker.pid)  # a set of one
    before = worker.log_path.stat().st_size
    os.kill(child, signal.SIGUSR1)  # as `kill -USR1 PID` (docs/worker.md); without a handler it would end it

    def dumped() -> str:
        with worker.log_path.open("rb") as log:
            log.seek(before)
            return log.read().decode(errors="replace")

    # The dump is written frame by frame, the handler's first and the pool process's entry point last:
    # wait for that, not a part (CI read one cut short after `handle`).
    stacks = wait_for(lambda: "child_main" in (text := dumped()) and text, "the pool process's stacks in the log")
    assert "in handle" in stacks and "recorder.py" in stacks, stacks
    wait_for(lambda: handled_count(db_url) == 1, "the handler finished")
    assert pool_processes(worker.pid) == {child}  # the same pool process, not a replacement
