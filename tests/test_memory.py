"""qmq/memory.py: server processes keep large freed buffers for reuse where the C library is glibc
(this machine's), unless QMQ_KEEP_LARGE_BUFFERS=0 says not to; and collect their garbage less often,
unless QMQ_TUNE_GC=0 says not to."""

from __future__ import annotations

import gc
import platform

from qmq.memory import ENV_SWITCH, GC_SWITCH, GC_YOUNG_THRESHOLD, collect_less, keep_large_buffers


def test_glibc_takes_the_settings_and_the_switch_turns_them_off(monkeypatch) -> None:
    assert platform.libc_ver()[0] == "glibc"  # what CI and the Docker image run on
    assert keep_large_buffers() is True
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert keep_large_buffers() is False


def test_the_collector_runs_less_often_and_the_switch_leaves_it_alone(monkeypatch) -> None:
    before = gc.get_threshold()
    try:
        monkeypatch.setenv(GC_SWITCH, "0")
        assert collect_less() is False
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
        monkeypatch.delenv(GC_SWITCH)
        assert collect_less() is True
        assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD
        assert gc.get_freeze_count() > 0  # what the start made is never walked again
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
