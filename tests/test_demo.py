"""`qmq demo`, the README's main job, end to end on a small shop: it must keep accounting for every
message (its exit code says so)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import PG_ADMIN_URL, SPARK_CONF_DIR
from tests.support.broker import ROOT


def demo(tmp_path, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "qmq", "demo", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "QMQ_PG_ADMIN_URL": PG_ADMIN_URL,
            "HOME": str(tmp_path),
            "SPARK_CONF_DIR": SPARK_CONF_DIR,
        },
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_the_demo_accounts_for_every_message_on_a_tls_cluster(tmp_path) -> None:
    """`qmq demo --tls`: every server TLS only, every client (this process, the workers, the shop
    that crashes, the relay) trusting the session's CA. It runs the same demo as without --tls, so it
    stands for both in CI (one demo run: about a minute); the plain cluster is tested in
    tests/test_dev.py, the plain demo below with `-m soak`."""
    result = demo(tmp_path, "--orders", "30", "--tls")
    assert "relay) over TLS in" in result.stdout
    check_account(result.stdout)


@pytest.mark.soak
def test_the_demo_accounts_for_every_message(tmp_path) -> None:
    check_account(demo(tmp_path, "--orders", "30").stdout)


def check_account(stdout: str) -> None:
    assert "every committed message is accounted for" in stdout
    assert "not shipped                              0" in stdout
    assert "dead-lettered (gift wrapping)            2" in stdout  # orders 1 and 26 are gifts
