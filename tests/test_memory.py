"""qmq/memory.py: server processes keep large freed buffers for reuse where the C library is glibc
(this machine's), unless QMQ_KEEP_LARGE_BUFFERS=0 says not to."""

from __future__ import annotations

import platform

from qmq.memory import ENV_SWITCH, keep_large_buffers


def test_glibc_takes_the_settings_and_the_switch_turns_them_off(monkeypatch) -> None:
    assert platform.libc_ver()[0] == "glibc"  # what CI and the Docker image run on
    assert keep_large_buffers() is True
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert keep_large_buffers() is False
