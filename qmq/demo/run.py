"""`qmq demo`: the whole path of a message on the embedded cluster, with the faults qmq is for, then
the reconciliation's verdict.

A shop places orders with `@qmq.transactional` (PostgreSQL); some payments are declined and roll
back; every order also schedules a payment timeout (a delayed message); two `qmq worker` processes
bill, e-mail and cancel unpaid orders with SQL idempotency; some e-mails fail twice before they work;
gift wrapping always fails and ends dead-lettered; one shop process is SIGKILLed right after its
commit and the relay ships its messages. Then the brokers' ledger is exported and `qmq reconcile`
accounts for every message.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import sqlalchemy as sa

import qmq
from qmq.db.engine import create_engine
from qmq.demo.shop import PaymentDeclined, emails, invoices, metadata, order_placer, timeouts
from qmq.dev.cluster import DevCluster
from qmq.net.client import BlockingConnection
from qmq.net.tls import TLS_CA_ENV, ClientTLS, configure_client
from qmq.protocol.codes import RequestCode

PG_ADMIN_ENV = "QMQ_PG_ADMIN_URL"
PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DECLINE_EVERY = 10  # every 10th payment is declined: the order and its messages roll back
GIFT_EVERY = 25  # every 25th order is a gift: its wrapping always fails
PAID_EVERY = 2  # every 2nd order is paid at once; the others are cancelled by their payment timeout
CRASH_ORDER_ID = 100_000
SETTLE_DEADLINE_S = 90.0
WORKERS = 2

CRASHING_SHOP = textwrap.dedent("""
    import os, signal, sys
    import qmq
    from qmq.db.engine import create_engine
    from qmq.demo.shop import order_placer

    producer = qmq.Producer(meta=sys.argv[2], engine=create_engine(sys.argv[1]), insert_lease_s=2.0)
    producer.handoff = lambda shipments: os.kill(os.getpid(), signal.SIGKILL)  # dies right after the commit
    order_placer(producer)(order_id=int(sys.argv[3]), item="crash-test dummy", pay=True)
""")


@dataclass
class Plan:
    """Which orders commit, which pay, which are gifts: decided up front so the end can be checked."""

    count: int

    def ids(self) -> range:
        return range(1, self.count + 1)

    def declined(self, order_id: int) -> bool:
        return order_id % DECLINE_EVERY == 0

    def gift(self, order_id: int) -> bool:
        return order_id % GIFT_EVERY == 1

    def paid(self, order_id: int) -> bool:
        return order_id % PAID_EVERY == 0

    def committed(self) -> list[int]:
        return [*[i for i in self.ids() if not self.declined(i)], CRASH_ORDER_ID]


class Progress:
    """One status line, rewritten in a terminal, printed every few seconds otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.last = 0.0

    def step(self, text: str) -> None:
        self.end()
        print(f"- {text}", flush=True)

    def status(self, text: str) -> None:
        if self.tty:
            print(f"\r  {text}\033[K", end="", flush=True)
        elif time.monotonic() - self.last > 5:
            print(f"  {text}", flush=True)
        self.last = time.monotonic()

    def end(self) -> None:
        if self.tty and self.last:
            print()
        self.last = 0.0


def run_demo(order_count: int = 200, keep: bool = False, tls: bool = False) -> int:
    """Run the demo (with `tls`, on a cluster that speaks TLS only); 0 when the reconciliation
    accounts for every message as expected."""
    progress = Progress()
    started = datetime.now(UTC) - timedelta(seconds=5)
    work = Path(tempfile.mkdtemp(prefix="qmq-demo-"))
    admin = os.environ.get(PG_ADMIN_ENV, PG_ADMIN_URL)
    db_name = f"qmq_demo_{uuid.uuid4().hex[:8]}"
    try:
        with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{db_name}"')
    except psycopg.Error as exc:
        print(
            f"qmq demo needs PostgreSQL ({admin}, or set ${PG_ADMIN_ENV}): {exc}\n"
            "bash scripts/demo.sh starts one on a fresh Debian machine.",
            file=sys.stderr,
        )
        return 2
    db_url = admin.rsplit("/", 1)[0] + "/" + db_name
    cluster = DevCluster(work / "cluster", outbox_url=db_url, meta_port=0, broker_port=0, delay_port=0, tls=tls)
    workers: list[subprocess.Popen] = []
    engine = None
    try:
        over = " over TLS" if tls else ""
        progress.step(f"starting the embedded cluster (meta server, broker, delay server, relay){over} in {work}")
        cluster.start()
        engine = create_engine(db_url, pool_size=8)
        metadata.create_all(engine)
        env = {**os.environ, "QMQ_META": cluster.meta, "QMQ_DB_URL": db_url}
        if cluster.tls_ca is not None:  # this process's clients, and the workers' and the crashing shop's
            configure_client(ClientTLS(cluster.tls_ca))
            env[TLS_CA_ENV] = cluster.tls_ca
        for n in range(WORKERS):
            with open(work / f"worker-{n}.log", "ab") as log:
                workers.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "qmq",
                            "worker",
                            "-A",
                            "qmq.demo.consumers:app",
                            "-c",
                            "4",
                            "-n",
                            f"demo-{n}",
                            "-l",
                            "INFO",
                        ],
                        env=env,
                        stdout=log,
                        stderr=log,
                        start_new_session=True,
                    )
                )
        plan = Plan(order_count)
        producer = qmq.Producer(meta=cluster.meta, engine=engine)
        produced = place_orders(plan, producer, progress)
        progress.step("a shop process commits an order and is SIGKILLed before it can send it")
        crash = subprocess.run(
            [sys.executable, "-c", CRASHING_SHOP, db_url, cluster.meta, str(CRASH_ORDER_ID)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if crash.returncode != -signal.SIGKILL:
            raise RuntimeError(f"the crashing shop did not crash as planned: {crash.stderr[-2000:]}")
        produced += 2  # its order.created and payment.timeout, committed, left for the relay
        producer.close()
        progress.step("waiting for workers: billing, e-mails (some retried), payment timeouts, gift wrapping")
        settle(plan, engine, cluster.broker, progress)
        for proc in workers:
            _stop(proc)  # a warm shutdown: their last acknowledgements reach the broker
        progress.step("reconciling: ledger export from the broker and the delay server, then Spark")
        summary = reconcile(cluster, db_url, work, started)
        return report(plan, engine, produced, summary, progress)
    finally:
        progress.end()
        for proc in workers:
            _stop(proc)
        cluster.stop()
        if engine is not None:
            engine.dispose()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        if keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def place_orders(plan: Plan, producer: qmq.Producer, progress: Progress) -> int:
    progress.step(
        f"placing {plan.count} orders: every {DECLINE_EVERY}th payment declined (rolled back), "
        f"every {GIFT_EVERY}th a gift, a payment timeout for each"
    )
    place_order = order_placer(producer)
    produced = 0

    def place(order_id: int) -> int:
        try:
            return len(
                place_order(
                    order_id=order_id,
                    item=f"item-{order_id}",
                    pay=plan.paid(order_id),
                    decline=plan.declined(order_id),
                    gift=plan.gift(order_id),
                )
            )
        except PaymentDeclined:
            return 0

    with ThreadPoolExecutor(4) as pool:
        for done, sent in enumerate(pool.map(place, plan.ids()), 1):
            produced += sent
            progress.status(f"orders {done}/{plan.count}, messages committed {produced}")
    producer.flush(30)
    return produced


def settle(plan: Plan, engine: sa.Engine, broker: str, progress: Progress) -> None:
    committed = plan.committed()
    gifts = sum(1 for i in committed if plan.gift(i))

    def counts() -> tuple[int, int, int, int]:
        with engine.connect() as conn:
            billed, mailed, timed_out = (
                conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()
                for t in (invoices, emails, timeouts)
            )
        return billed, mailed, timed_out, dead_letters(broker, "order.gift")

    deadline = time.monotonic() + SETTLE_DEADLINE_S
    while True:
        billed, mailed, timed_out, dead = counts()
        progress.status(
            f"billed {billed}/{len(committed)}, e-mailed {mailed}/{len(committed)}, "
            f"payment timeouts {timed_out}/{len(committed)}, gifts dead-lettered {dead}/{gifts}"
        )
        if (billed, mailed, timed_out, dead) == (len(committed), len(committed), len(committed), gifts):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the workers did not finish within {SETTLE_DEADLINE_S:.0f} s")
        time.sleep(0.25)


def dead_letters(broker: str, subject: str) -> int:
    host, port = broker.rsplit(":", 1)
    with BlockingConnection.open(host, int(port), client_id="qmq-demo") as conn:
        stats = conn.request(RequestCode.BROKER_STATS, {})
    return sum(g["dead"] for g in stats["groups"] if g["subject"] == subject)


def reconcile(cluster: DevCluster, db_url: str, work: Path, since: datetime) -> dict:
    ledger, out = work / "ledger", work / "reconciliation"
    qmq_cli: Callable[..., None] = lambda *args: _run([sys.executable, "-m", "qmq", *args])  # noqa: E731
    cluster.stop()  # a quiet store: every acknowledgement is in the ledger
    qmq_cli("ledger", "export", "--data-dir", str(cluster.data_dir / "broker"), "--out", str(ledger), "--name", "dev")
    qmq_cli("ledger", "export", "--data-dir", str(cluster.data_dir / "delay"), "--out", str(ledger), "--name", "delay")
    until = datetime.now(UTC) + timedelta(seconds=1)
    qmq_cli(
        "reconcile",
        "--outbox-db",
        db_url,
        "--consumed-db",
        db_url,
        "--ledger",
        str(ledger),
        "--out",
        str(out),
        "--since",
        since.isoformat(),
        "--until",
        until.isoformat(),
        "--grace",
        "0s",
        "--master",
        "local[2]",
    )
    return json.loads((out / "summary.json").read_text())


def report(plan: Plan, engine: sa.Engine, produced: int, summary: dict, progress: Progress) -> int:
    progress.end()
    committed = plan.committed()
    with engine.connect() as conn:
        retried = conn.execute(sa.select(sa.func.count()).where(emails.c.attempts > 1)).scalar_one()
        cancelled = conn.execute(sa.select(sa.func.count()).where(timeouts.c.cancelled)).scalar_one()
    declined = sum(1 for i in plan.ids() if plan.declined(i))
    lines = [
        ("orders committed", len(committed)),
        ("orders rolled back (no message exists)", declined),
        ("messages produced", produced),
        ("  of which delayed (payment timeouts)", len(committed)),
        ("delivered", summary.get("delivered", 0)),
        ("retried before success (e-mails)", retried),
        ("dead-lettered (gift wrapping)", summary.get("dead_lettered", 0)),
        ("redelivered", summary.get("redelivered", 0)),
        ("orphaned", summary.get("orphaned", 0)),
        ("not shipped", summary.get("not_shipped", 0)),
        ("not acked", summary.get("not_acked", 0)),
        ("orders cancelled by their payment timeout", cancelled),
    ]
    print("\nqmq demo: the reconciliation's account of every message")
    for label, value in lines:
        print(f"  {label:<40} {value}")
    ok = summary.get("not_shipped", 1) == 0 and summary.get("not_acked", 1) == 0
    print("\nevery committed message is accounted for" if ok else "\nSOME MESSAGES ARE NOT ACCOUNTED FOR")
    return 0 if ok else 1


def _run(args: list[str]) -> None:
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[2:5])} failed ({result.returncode}): {result.stderr[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
