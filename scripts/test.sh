#!/usr/bin/env bash
# The test command: set-up (virtualenv, install, PostgreSQL and Redis), ruff, then pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k protocol -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${QMQ_VENV:-$(pwd)/.venv}
echo "[test] ruff"
"$VENV/bin/ruff" check .
echo "[test] ruff format --check"
"$VENV/bin/ruff" format --check . || { echo "[test] the formatter would change the files above: run '$VENV/bin/ruff format .'" >&2; exit 1; }
echo "[test] pytest"
# Three workers, a test file each at a time (the files that share a SparkSession on one worker, so
# one JVM starts: tests/conftest.py): most tests wait on servers, sockets and fsyncs, not on the CPU.
# QMQ_TEST_WORKERS=0 runs everything in this process (for pdb, or -x on one failure).
WORKERS=${QMQ_TEST_WORKERS:-3}
exec "$VENV/bin/python" -m pytest -n "$WORKERS" --dist loadfile --durations=25 "$@"
