"""A real PgBouncer in transaction mode in front of the test PostgreSQL server, for the tests of what
the after-commit sender and the relay leave on a connection that other clients share.

`start_pgbouncer` writes a config of its own (trust auth, one server connection per database and
user, so that every client's transactions run on the same server connection), starts `pgbouncer`
as a child of `processes` and returns its port. PgBouncer refuses to run as root: as root it is
started with `-u nobody`, which it switches to after reading its config. scripts/setup.sh installs it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psycopg

from tests.support.processes import free_port, wait_for_port

PGBOUNCER_USER_AS_ROOT = "nobody"


def start_pgbouncer(processes, conf_dir: Path, pg_host: str, pg_port: int) -> int:
    """PgBouncer, pool_mode = transaction, default_pool_size = 1, for every database on
    `pg_host:pg_port`, its config in `conf_dir`; its port."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    assert Path(binary).exists(), "pgbouncer is not installed: scripts/setup.sh installs it (Debian: pgbouncer)"
    port = free_port()
    conf_dir.mkdir(parents=True, exist_ok=True)
    users = conf_dir / "users.txt"
    users.write_text('"postgres" ""\n')
    ini = conf_dir / "pgbouncer.ini"
    ini.write_text(
        f"""[databases]
* = host={pg_host} port={pg_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {users}
pool_mode = transaction
default_pool_size = 1
max_client_conn = 100
logfile =
pidfile =
ignore_startup_parameters = extra_float_digits,options
"""
    )
    as_user = ["-u", PGBOUNCER_USER_AS_ROOT] if os.geteuid() == 0 else []
    proc = processes.start([binary, *as_user, str(ini)], name="pgbouncer", python=False)
    wait_for_port(port, proc)
    return port


def shared_session(url: str) -> tuple[str, str, int]:
    """What a new client of PgBouncer finds on the (one) server connection: synchronous_commit,
    idle_in_transaction_session_timeout, and how many named prepared statements it holds."""
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True, prepare_threshold=None) as conn:
        return (
            conn.execute("SHOW synchronous_commit").fetchone()[0],
            conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()[0],
            conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()[0],
        )
