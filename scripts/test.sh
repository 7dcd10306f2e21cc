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
exec "$VENV/bin/python" -m pytest "$@"
