#!/usr/bin/env bash
# Prepare this checkout on a fresh Debian machine: a virtualenv with qmq and its test extras,
# PostgreSQL and Redis reachable on 127.0.0.1. Idempotent: a second run only checks.
#   QMQ_VENV        where the virtualenv lives (default: .venv in the checkout)
#   QMQ_PG_ADMIN_URL  the PostgreSQL server the tests use (default postgresql://postgres@127.0.0.1:5432/postgres)
#   QMQ_REDIS_URL   the Redis server the tests use (default redis://127.0.0.1:6379/0)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${QMQ_VENV:-$ROOT/.venv}
PG_HOST=127.0.0.1
PG_PORT=5432
REDIS_PORT=6379

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }
is_root() { [ "$(id -u)" = 0 ]; }
APT_LOCK_WAIT_S=600  # how long apt-get waits for another one's dpkg lock
apt_install() {
    is_root && command -v apt-get >/dev/null || return 1
    say "installing with apt-get: $*"
    # Another apt-get (a second set-up, the system's own updates) may hold dpkg's lock: wait for it.
    local lock=(-o "DPkg::Lock::Timeout=$APT_LOCK_WAIT_S")
    if [ -z "${QMQ_APT_UPDATED:-}" ]; then apt-get "${lock[@]}" update -qq; QMQ_APT_UPDATED=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get "${lock[@]}" install -y -qq "$@" >/dev/null
}
port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }
wait_port() {  # host port what
    for _ in $(seq 1 60); do port_open "$1" "$2" && return 0; sleep 0.5; done
    return 1
}

# --- Python and the virtualenv -------------------------------------------------------------
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    for c in python3.13 python3.12 python3.11 python3; do
        if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
            PY=$(command -v "$c"); break
        fi
    done
fi
if [ -z "$PY" ]; then
    apt_install python3 python3-venv python3-dev || die "Python 3.11+ is required: install python3 (3.11 or newer) and python3-venv"
    PY=$(command -v python3)
fi
if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtualenv $VENV"
    if ! "$PY" -m venv "$VENV" 2>/dev/null; then
        apt_install python3-venv || die "the venv module is missing: install python3-venv"
        "$PY" -m venv "$VENV"
    fi
fi
# The store's compiled loops (setup.py, qmq/store/_speedups.pyx) need a C compiler and zlib's
# headers; without them qmq installs anyway and runs its pure-Python loops, slower.
if ! command -v cc >/dev/null; then
    apt_install gcc libc6-dev || say "no C compiler: the store's loops will run in pure Python"
fi
if ! echo '#include <zlib.h>' | cc -E - >/dev/null 2>&1; then
    apt_install zlib1g-dev || say "no zlib headers: the store's loops will run in pure Python"
fi
if ! "$PY" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
    apt_install python3-dev || say "no Python headers: the store's loops will run in pure Python"
fi
STAMP="$VENV/.qmq-installed"
WANT=$(cat pyproject.toml setup.py qmq/store/_speedups.pyx qmq/_ids.pyx qmq/client/_wire.pyx qmq/broker/_sending.pyx | sha1sum | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    say "installing qmq with test extras into $VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
    "$VENV/bin/python" -m pip install -q -e ".[test]"
    echo "$WANT" > "$STAMP"
fi

# --- PostgreSQL ---------------------------------------------------------------------------
pg_start_installed() {
    if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
        local ver
        ver=$(ls /etc/postgresql | sort -V | tail -n 1)
        [ -n "$ver" ] || return 1
        say "starting PostgreSQL $ver"
        pg_ctlcluster --skip-systemctl-redirect "$ver" main start || return 1
        return 0
    fi
    return 1
}
pg_trust_loopback() {  # only on a cluster this script installed itself
    local hba
    hba=$(ls /etc/postgresql/*/main/pg_hba.conf | sort -V | tail -n 1)
    if ! grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
        say "allowing trust auth on 127.0.0.1 in $hba (test machine)"
        sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
        pg_ctlcluster --skip-systemctl-redirect "$(basename "$(dirname "$(dirname "$hba")")")" main reload || true
    fi
}
if [ -z "${QMQ_PG_ADMIN_URL:-}" ]; then
    if ! port_open "$PG_HOST" "$PG_PORT"; then
        if ! pg_start_installed; then
            apt_install postgresql || die "PostgreSQL is not reachable on $PG_HOST:$PG_PORT and cannot be installed here: install and start PostgreSQL (Debian: apt-get install postgresql), or set QMQ_PG_ADMIN_URL"
            pg_start_installed || true
            pg_trust_loopback
        fi
        wait_port "$PG_HOST" "$PG_PORT" || die "PostgreSQL did not come up on $PG_HOST:$PG_PORT"
    fi
fi

# --- Redis --------------------------------------------------------------------------------
if [ -z "${QMQ_REDIS_URL:-}" ] && ! port_open 127.0.0.1 "$REDIS_PORT"; then
    if ! command -v redis-server >/dev/null; then
        apt_install redis-server || die "Redis is not reachable on 127.0.0.1:$REDIS_PORT and cannot be installed here: install redis-server, or set QMQ_REDIS_URL"
    fi
    say "starting Redis"
    redis-server --daemonize yes --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no >/dev/null
    wait_port 127.0.0.1 "$REDIS_PORT" || die "Redis did not come up on 127.0.0.1:$REDIS_PORT"
fi
# --- PgBouncer, which tests/test_outbox_pgbouncer.py starts in front of PostgreSQL (transaction mode) ---
if ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ]; then
    apt_install pgbouncer || die "pgbouncer is missing and cannot be installed here: install Debian's pgbouncer package"
fi
# --- the compose cluster's test (tests/test_compose.py): Debian's docker.io (dockerd, which the test
# starts when no daemon runs), docker-compose, and debootstrap for the local base image -----------------
if ! command -v docker-compose >/dev/null; then
    apt_install docker-compose || die "docker-compose is missing and cannot be installed here: install Debian's docker-compose package"
fi
if ! command -v dockerd >/dev/null; then
    apt_install docker.io || die "dockerd is missing and cannot be installed here: install Debian's docker.io package"
fi
if ! command -v debootstrap >/dev/null; then
    apt_install debootstrap || die "debootstrap is missing and cannot be installed here: install Debian's debootstrap package"
fi
# --- the reconciliation's Spark: Java 17+ and Debian's PostgreSQL JDBC driver (tests/test_reconcile*.py) ------
if ! command -v java >/dev/null; then
    apt_install openjdk-17-jre-headless || die "Java is missing and cannot be installed here: install a Java 17+ runtime (Debian: openjdk-17-jre-headless)"
fi
if [ ! -f /usr/share/java/postgresql.jar ] && [ -z "${QMQ_JDBC_JAR:-}" ]; then
    apt_install libpostgresql-jdbc-java || die "the PostgreSQL JDBC driver is missing and cannot be installed here: install Debian's libpostgresql-jdbc-java, or set QMQ_JDBC_JAR to a postgresql-*.jar"
fi
# --- the web console's browser test (tests/test_console.py): Debian's Chromium, driven by Playwright
# for Python with executable_path=/usr/bin/chromium (never `playwright install`) ---------------------
if [ ! -x /usr/bin/chromium ]; then
    apt_install chromium chromium-driver || die "Chromium is missing and cannot be installed here: install Debian's chromium package (or set QMQ_CHROMIUM to a Chromium binary)"
fi
say "$("$VENV/bin/python" -c 'from qmq.store import speedups; print(speedups.describe())')"
say "ready: $VENV"
