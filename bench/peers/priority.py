"""Every server of the comparison at the benchmark's own scheduling priority.

The benchmark is run under `nice -n -15` (docs/benchmarks.md) so that other work on the machine
disturbs it less; the qmq broker it starts inherits that, while a peer started by the machine's init
runs at niceness 0. On Linux a niceness belongs to each thread, so `renice -p PID` of a server
changes its main thread only: NATS's worker threads stayed at 0 when it was "reniced" that way. So
before a peer is measured, every thread of the process listening on its port, and of that process's
children (PostgreSQL's backends and writers), gets the benchmark's niceness. (Measured on an idle
machine, it mattered little: NATS at 0 against -15, alternated, produced 30,600 - 31,600 against
32,200 - 34,700 msg/s; it matters when other work competes for the cores.) Lowering a niceness needs
root (or CAP_SYS_NICE); where it is refused, the line printed says the comparison is uneven. Once
the peer is measured, `restore` gives each thread that is still there its niceness back, so the
machine's own services do not stay at the benchmark's.

Linux only (/proc); elsewhere it says it could not tell.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
_changed: dict[int, int] = {}  # thread id -> its niceness before `match` changed it
TCP_LISTEN = "0A"  # the state column of /proc/net/tcp for a listening socket


def listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on TCP `port` (IPv4 and IPv6)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == TCP_LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def listener_pids(port: int) -> set[int]:
    """The processes holding a socket that listens on `port` (only those this user may inspect)."""
    wanted = {f"socket:[{inode}]" for inode in listening_inodes(port)}
    pids = set()
    for entry in PROC.iterdir() if wanted else ():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in wanted for fd in (entry / "fd").iterdir()):
                pids.add(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def with_children(pids: set[int]) -> set[int]:
    """`pids` and every process descended from them."""
    parents: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    family = set(pids)
    grew = True
    while grew:
        found = {pid for pid, parent in parents.items() if parent in family} - family
        family |= found
        grew = bool(found)
    return family


def threads(pid: int) -> list[int]:
    """The thread ids of `pid`: on Linux a niceness belongs to a thread, not to its process."""
    try:
        return [int(t.name) for t in (PROC / str(pid) / "task").iterdir()]
    except OSError:
        return []


def match(port: int, label: str) -> str:
    """Give the servers listening on `port` this process's niceness; a line saying what was done."""
    if not PROC.is_dir():
        return f"# {label}: priority not checked (no /proc)"
    own = os.getpriority(os.PRIO_PROCESS, 0)
    pids = with_children(listener_pids(port))
    if not pids:
        return f"# {label}: no process found listening on port {port}: its niceness could not be matched"
    changed, refused = 0, 0
    for pid in pids:
        for tid in threads(pid):
            try:
                before = os.getpriority(os.PRIO_PROCESS, tid)
                if before != own:
                    os.setpriority(os.PRIO_PROCESS, tid, own)
                    _changed.setdefault(tid, before)
                    changed += 1
            except PermissionError:
                refused += 1
            except ProcessLookupError:
                continue
    if refused:
        return (
            f"# {label}: UNEVEN comparison: {refused} of its threads could not be given niceness {own} "
            "(needs root); run the benchmark without nice, or as root"
        )
    return f"# {label}: {len(pids)} process(es) on port {port} at niceness {own} ({changed} threads changed)"


def restore() -> int:
    """Give every thread `match` changed its niceness back (those still running); how many."""
    restored = 0
    for tid, before in list(_changed.items()):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, before)
            restored += 1
        except (PermissionError, ProcessLookupError):
            pass
        del _changed[tid]
    return restored
