"""Real server processes for tests: started in their own process group, tied to the test run's life
(they die with it even if pytest is SIGKILLed), and always stopped at teardown."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from qmq.net.probe import accepts

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 5.0
KILL_WAIT_S = 30.0  # for a process to end after `kill`
STACKS_WAIT_S = 2.0  # for a process that did not end to write its threads' stacks (SIGUSR1)
READY_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 40  # of each child process, printed when a test fails


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def wait_for_port(port: int, proc: subprocess.Popen | None = None, timeout: float = READY_TIMEOUT_S) -> None:
    """Wait until something accepts on 127.0.0.1:port; fail early if `proc` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        if accepts("127.0.0.1", port):
            return
        time.sleep(0.02)  # polling a port: there is no event to await from outside the process
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout}s")


def thread_stacks(proc: subprocess.Popen) -> str:
    """Ask a qmq process for its threads' stacks and return what it wrote to its log, once the log
    stops growing (at most STACKS_WAIT_S)."""
    log_path: Path | None = getattr(proc, "log_path", None)
    if log_path is None:
        return "(no log to read the stacks from)"
    before = log_path.stat().st_size
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + STACKS_WAIT_S
    size = before
    while time.monotonic() < deadline:
        time.sleep(0.1)  # the dump is written from the process's signal handler: no event to await here
        grown = log_path.stat().st_size
        if grown == size and grown > before:
            break
        size = grown
    with log_path.open("rb") as log:
        log.seek(before)
        return log.read().decode(errors="replace") or "(it wrote nothing)"


class ProcessManager:
    """Starts child processes and guarantees they are gone when `stop_all` returns."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []  # every child's log, in start order (kept after stop_all)

    def start(
        self, args: Sequence[str], *, name: str, env: dict | None = None, python: bool = True, stdout=None
    ) -> subprocess.Popen:
        cmd = [sys.executable, *args] if python else list(args)
        log = open(self.log_dir / f"{name}-{len(self.procs)}.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            cmd,
            stdout=stdout if stdout is not None else log,
            stderr=log,
            env={**os.environ, **(env or {})},
            preexec_fn=_die_with_parent,
        )
        proc.log_path = Path(log.name)  # type: ignore[attr-defined]
        log.close()
        self.logs.append(proc.log_path)  # each start has a log of its own (named with its index)
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen, sig: int = signal.SIGKILL, timeout_s: float = KILL_WAIT_S) -> int:
        """Send `sig` to the process group and wait for the process to end. One that does not end is
        asked for its threads' stacks (`kill -USR1`, qmq/stacks.py), which the error
        carries: a CI run that meets a hung stop says where it hung."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            name, stacks = signal.Signals(sig).name, thread_stacks(proc)
            raise AssertionError(
                f"{proc.args!r} did not end within {timeout_s:g} s of {name}; its threads:\n{stacks}"
            ) from None

    def log_tails(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` of each child's log: what a failed test prints, so a CI flake can be read."""
        parts = []
        for path in self.logs:
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"----- {path.name} (last {len(tail)} lines) -----\n" + "\n".join(tail))
        return "\n".join(parts)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group, grandchildren too
            proc.wait(timeout=30)
        self.procs.clear()
