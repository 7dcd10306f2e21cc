#!/usr/bin/env bash
# The main job: the end-to-end demo on the embedded cluster (`qmq demo`), after the set-up
# (virtualenv, install, PostgreSQL). Extra arguments go to `qmq demo`, e.g. `--orders 500 --keep`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${QMQ_VENV:-$(pwd)/.venv}
exec "$VENV/bin/python" -m qmq demo "$@"
