"""`qmq.testing` as an application uses it: the sample shop (tests/apps/eager_shop/) runs its own
pytest suite, in which its billing consumer runs in-process on commit, with no qmq server."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.broker import ROOT

SHOP = ROOT / "tests" / "apps" / "eager_shop"


def test_the_sample_shops_own_tests_run_its_consumer_on_commit() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QMQ_")}  # nothing to reach: no servers
    env["QMQ_META"] = "127.0.0.1:9"  # the discard port: a send to it would fail, and none is made
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q"], cwd=SHOP, capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed" in result.stdout
