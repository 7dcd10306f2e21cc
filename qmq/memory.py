"""How a qmq server process keeps its memory.

A broker allocates and frees large buffers all the time: a pull reply of a megabyte, a chunk shipped
to a replica, a range of the message log read at once. glibc serves each allocation over 128 KiB
with fresh pages from the kernel (mmap) and gives them back when it is freed, so every such buffer
pays its page faults again: encoding a 1,024-message pull reply took 1.8 ms that way against 0.85 ms
with the buffers kept (docs/benchmarks.md). `keep_large_buffers` has glibc serve them from its heap
and keep up to TRIM_THRESHOLD_BYTES of freed heap for the next one: the cost is that much memory
held after a burst. Server processes call it at start (`qmq.net.server.run_process`); a library
user's process is left as it is. Set QMQ_KEEP_LARGE_BUFFERS=0 to keep glibc's defaults.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

ENV_SWITCH = "QMQ_KEEP_LARGE_BUFFERS"
# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # allocations below this come from the heap (glibc's maximum)
TRIM_THRESHOLD_BYTES = 64 * 1024 * 1024  # freed heap kept for reuse, at most


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
