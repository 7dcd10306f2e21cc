"""`qmq.relay_sweep` run by a real Celery worker on Redis: it ships what an outbox left behind, once,
however many sweeps run."""

from __future__ import annotations

import importlib
import os
import uuid

import pytest

import qmq
from qmq.db.engine import create_engine
from qmq.db.migrate import upgrade
from tests.support.broker import ROOT, start_broker
from tests.support.databases import fresh_database
from tests.support.outbox import consume, states
from tests.test_meta import log_text, wait_until

TASK_TIMEOUT_S = 60


@pytest.fixture
def celery_app(redis_prefix, monkeypatch):
    monkeypatch.setenv("QMQ_TEST_CELERY_PREFIX", f"{redis_prefix}celery:")
    monkeypatch.setenv("QMQ_TEST_CELERY_QUEUE", f"qmq-test-{uuid.uuid4().hex[:8]}")
    import tests.apps.celery_app as module

    module = importlib.reload(module)  # picks up this test's queue and prefix
    yield module.app
    module.app.close()


@pytest.fixture
def worker(processes, celery_app):
    proc = processes.start(
        [
            "-m",
            "celery",
            "-A",
            "tests.apps.celery_app",
            "worker",
            "--pool",
            "solo",
            "--loglevel",
            "INFO",
            "--without-heartbeat",
            "--without-mingle",
            "--without-gossip",
        ],
        name="celery-worker",
        env={
            "PYTHONPATH": str(ROOT),
            "QMQ_TEST_CELERY_PREFIX": os.environ["QMQ_TEST_CELERY_PREFIX"],
            "QMQ_TEST_CELERY_QUEUE": os.environ["QMQ_TEST_CELERY_QUEUE"],
            "QMQ_META": "",
        },
    )
    wait_until(lambda: "ready" in log_text(proc), "the Celery worker is ready", deadline_s=60)
    return proc


def test_a_celery_worker_runs_relay_sweeps(pg_url, processes, tmp_path, celery_app, worker) -> None:
    broker = start_broker(processes, tmp_path / "broker")
    with fresh_database(pg_url) as url:
        upgrade(url)
        engine = create_engine(url)
        producer = qmq.Producer(brokers=["127.0.0.1:1"], engine=engine, after_commit=False)
        ids = [producer.send_now("invoice.issued", {"n": n}) for n in range(40)]
        producer.close()

        kwargs = {"db": url, "brokers": [broker.address], "batch_rows": 16}
        sweeps = [celery_app.send_task("qmq.relay_sweep", kwargs=kwargs) for _ in range(2)]
        reports = [report for sweep in sweeps for report in sweep.get(timeout=TASK_TIMEOUT_S)]
        assert sum(r["shipped"] for r in reports) == 40 and all(not r["errors"] for r in reports)
        assert reports[-1]["pending"] == 0
        assert states(engine) == dict.fromkeys(ids, "sent")
        delivered = consume(broker.address, "invoice.issued", 40)
        assert sorted(d.id for d in delivered) == sorted(ids)
        engine.dispose()
