"""How a qmq server process keeps its memory.

A broker allocates and frees large buffers all the time: a pull reply of a megabyte, a chunk shipped
to a replica, a range of the message log read at once. glibc serves each allocation over 128 KiB
with fresh pages from the kernel (mmap) and gives them back when it is freed, so every such buffer
pays its page faults again: encoding a 1,024-message pull reply took 1.8 ms that way against 0.85 ms
with the buffers kept (docs/benchmarks.md). `keep_large_buffers` has glibc serve them from its heap
and keep up to TRIM_THRESHOLD_BYTES of freed heap for the next one: the cost is that much memory
held after a burst. Server processes call it at start (`qmq.net.server.run_process`); a library
user's process is left as it is. Set QMQ_KEEP_LARGE_BUFFERS=0 to keep glibc's defaults.

CPython's garbage collector walks its youngest generation every 700 container allocations, and now
and then every object the process holds; a process that makes a few dicts and lists per message
(the relay's rows, a batch's bookkeeping) spends a quarter of its CPU there: the relay's CPU per row
went from 14.9 to 11.0 µs with `collect_less` (docs/benchmarks.md). It freezes what the start
made (never walked again) and collects the youngest generation every GC_YOUNG_THRESHOLD
allocations; cycles are still collected, later. Set QMQ_TUNE_GC=0 to keep Python's defaults.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os

log = logging.getLogger(__name__)

ENV_SWITCH = "QMQ_KEEP_LARGE_BUFFERS"
# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # allocations below this come from the heap (glibc's maximum)
TRIM_THRESHOLD_BYTES = 64 * 1024 * 1024  # freed heap kept for reuse, at most
GC_SWITCH = "QMQ_TUNE_GC"
GC_YOUNG_THRESHOLD = 50_000  # net container allocations between collections of the youngest generation
GC_OLDER_THRESHOLDS = (50, 50)  # collections of a generation between two of the next older one


def keep_large_buffers() -> bool:
    """Ask the C library to keep large freed buffers for reuse. True when it took the settings;
    False where it is not glibc, or when QMQ_KEEP_LARGE_BUFFERS=0 says not to."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):  # not glibc (musl has no mallopt, macOS neither)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    taken = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    taken = taken and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not taken:
        log.debug("the C library refused the settings for large buffers; keeping its defaults")
    return taken


def collect_less() -> bool:
    """Freeze the objects made so far and have the garbage collector run less often (see above).
    True when set; False when QMQ_TUNE_GC=0 says not to."""
    if os.environ.get(GC_SWITCH, "1") == "0":
        return False
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *GC_OLDER_THRESHOLDS)
    return True
