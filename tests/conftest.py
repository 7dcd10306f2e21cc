"""Fixtures shared by every test: a PostgreSQL database and a Redis key space of this run's own,
free ports, real child processes that are always stopped, a broker, a meta server for replicated
groups, and an engine on the module's `db_url`."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import psycopg
import pytest
import redis

from qmq.db.engine import create_engine
from tests.support.broker import start_broker
from tests.support.databases import fresh_database
from tests.support.processes import ProcessManager, free_port
from tests.support.replication import HOST, start_meta

# Every Spark JVM a test starts (PySpark, spark-submit, `qmq reconcile`) takes the test settings.
SPARK_CONF_DIR = str(Path(__file__).resolve().parent / "spark-conf")
os.environ.setdefault("SPARK_CONF_DIR", SPARK_CONF_DIR)

PG_ADMIN_URL = os.environ.get("QMQ_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("QMQ_REDIS_URL", "redis://127.0.0.1:6379/0")
RUN_ID = f"{os.getpid()}_{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def pg_url():
    """A PostgreSQL database made for this test run and dropped after it."""
    name = f"qmq_test_{RUN_ID}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def redis_prefix():
    """A key prefix owned by this test run; its keys are deleted after it."""
    prefix = f"qmq_test:{RUN_ID}:"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)
    client.close()


@pytest.fixture
def redis_client():
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def processes(request, tmp_path):
    """Start real processes with `processes.start([...])`; all are killed at teardown, pass or fail.
    When the test failed, the tail of each process's log is printed (shown as teardown output)."""
    manager = ProcessManager(tmp_path)
    try:
        yield manager
    finally:
        manager.stop_all()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed and manager.logs:
            print(manager.log_tails())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item (`item.rep_call`) for fixtures' teardown to read."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def broker(processes, tmp_path):
    """A broker of the test's own, with its store in tmp_path/broker (a module that wants other
    flags defines its own `broker`)."""
    return start_broker(processes, tmp_path / "broker")


@pytest.fixture
def meta(processes, pg_url):
    """A meta server on a PostgreSQL database of its own, with the short failover settings of
    tests/support/replication.py: its address, for `--meta` (a module that wants others defines its
    own `meta`)."""
    with fresh_database(pg_url) as url:
        _, meta_port = start_meta(processes, url)
        yield f"{HOST}:{meta_port}"


@pytest.fixture
def engine(db_url):
    """An engine on the `db_url` the test's module defines."""
    engine = create_engine(db_url)
    yield engine
    engine.dispose()


# Test files that use the shared SparkSession (tests/support/reconcile.py): xdist runs them on one
# worker, so that one JVM starts rather than one per worker (tens of seconds of both cores each on a
# small machine). Every other file goes to a worker whole, as with --dist loadfile.
SPARK_FILES = {
    "tests/test_end_to_end.py",
    "tests/test_reconcile_ordering.py",
    "tests/test_reconcile_redrive.py",
    "tests/test_reconcile_scenario.py",
    "tests/test_reconcile_units.py",
}


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    class SparkFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return "spark" if file in SPARK_FILES else file

    return SparkFilesTogether(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """A file that starts using the shared SparkSession must be named in SPARK_FILES."""
    for item in items:
        file = item.nodeid.split("::")[0]
        if "spark" in getattr(item, "fixturenames", ()) and file not in SPARK_FILES:
            raise pytest.UsageError(f"{file} uses the `spark` fixture: add it to SPARK_FILES in tests/conftest.py")
