# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""`qmq.ids.new_id` compiled: the same UUIDv7 text, the same rules (RFC 9562 method 3: a 12-bit
counter after the millisecond, seeded at random each millisecond, borrowing the next millisecond
past 4,096 ids), in a twentieth of the Python version's time; a client makes one per message sent.

Atomic under the GIL: nothing here releases it or runs Python code between reading and writing the
state. The random bits come from splitmix64 seeded by the OS (`seed`, again in a forked child), as
the Python version's come from `random.Random` seeded by the OS: unpredictable enough to keep ids
of different processes apart, not for secrets.
"""

from cpython.unicode cimport PyUnicode_DecodeASCII
from libc.stdint cimport uint64_t
from posix.time cimport CLOCK_REALTIME, clock_gettime, timespec

cdef enum:
    COUNTER_BITS = 12

cdef uint64_t _last_ms = 0, _counter = 0, _random_state = 0
cdef const char* _HEX = b"0123456789abcdef"


def seed(uint64_t value) -> None:
    """Seed the random bits (from os.urandom; at import and in a forked child)."""
    global _random_state
    _random_state = value


def state():
    """(last ms, counter): for tests that move the clock and must put it back."""
    return _last_ms, _counter


def restore(uint64_t last_ms, uint64_t counter) -> None:
    global _last_ms, _counter
    _last_ms, _counter = last_ms, counter


cdef inline uint64_t _next_random() noexcept nogil:
    global _random_state
    _random_state += 0x9E3779B97F4A7C15ULL
    cdef uint64_t z = _random_state
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef inline void _hex(char* out, uint64_t value, int digits) noexcept nogil:
    cdef int i
    for i in range(digits - 1, -1, -1):
        out[i] = _HEX[value & 0xF]
        value >>= 4


def new_id_at(uint64_t ms):
    """The next id, `ms` being now in ms since the epoch."""
    global _last_ms, _counter
    if ms > _last_ms:
        _last_ms, _counter = ms, _next_random() & 0x7FF  # 11 bits: room to count up
    else:
        _counter += 1
        if _counter >> COUNTER_BITS:  # 4,096 ids in one millisecond: borrow the next one
            _last_ms, _counter = _last_ms + 1, 0
    cdef uint64_t rand_b = _next_random() >> 2  # 62 bits
    cdef char text[36]
    _hex(text, _last_ms >> 16, 8)
    text[8] = b"-"
    _hex(text + 9, _last_ms & 0xFFFF, 4)
    text[13] = b"-"
    text[14] = b"7"
    _hex(text + 15, _counter, 3)
    text[18] = b"-"
    _hex(text + 19, 0x8000 | (rand_b >> 48), 4)  # RFC 9562's variant bits, then rand_b
    text[23] = b"-"
    _hex(text + 24, rand_b & 0xFFFFFFFFFFFFULL, 12)
    return PyUnicode_DecodeASCII(text, 36, NULL)


def new_id():
    """A new UUIDv7 as its canonical 36-character string."""
    cdef timespec now
    clock_gettime(CLOCK_REALTIME, &now)
    return new_id_at(<uint64_t>now.tv_sec * 1000 + <uint64_t>now.tv_nsec // 1000000)
