"""`qmq demo`, the README's main job, end to end on a small shop: it must keep accounting for every
message (its exit code says so)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import PG_ADMIN_URL
from tests.support.broker import ROOT


def test_the_demo_accounts_for_every_message(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "qmq", "demo", "--orders", "30"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "QMQ_PG_ADMIN_URL": PG_ADMIN_URL, "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "every committed message is accounted for" in result.stdout
    assert "not shipped                              0" in result.stdout
    assert "dead-lettered (gift wrapping)            2" in result.stdout  # orders 1 and 26 are gifts
