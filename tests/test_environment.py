"""The test run's own services are real and isolated."""

import psycopg


def test_run_has_its_own_postgres_database(pg_url):
    with psycopg.connect(pg_url) as conn:
        name = conn.execute("SELECT current_database()").fetchone()[0]
        conn.execute("CREATE TABLE probe (id int)")
    assert name.startswith("qmq_test_")


def test_redis_is_reachable(redis_client, redis_prefix):
    redis_client.set(redis_prefix + "probe", b"1")
    assert redis_client.get(redis_prefix + "probe") == b"1"


def test_child_processes_are_stopped(processes):
    proc = processes.start(["-c", "import time; time.sleep(600)"], name="sleeper")
    assert proc.poll() is None
    processes.stop_all()
    assert proc.poll() is not None
