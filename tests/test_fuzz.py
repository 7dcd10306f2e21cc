"""The bounded CI form of bench/fuzz.py: 2,000 mutated frames against real meta, broker and delay
server processes, with canary clients. Any INTERNAL answer, crashed server or unanswered canary fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import PG_ADMIN_URL

ROOT = Path(__file__).resolve().parents[1]
FRAMES = 2000
RUN_TIMEOUT_S = 240


def test_fuzzed_frames_get_client_errors_and_the_servers_keep_serving():
    for seed in (1, 2):
        run = subprocess.run(
            [sys.executable, "bench/fuzz.py", "--frames", str(FRAMES), "--seed", str(seed), "--pg", PG_ADMIN_URL],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "fuzz: OK" in run.stdout
