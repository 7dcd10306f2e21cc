# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The group-commit fsync thread in C, for `--flush sync` (qmq/store/flush.py says when it is used).

What it is for: a Python flusher thread pays two GIL hand-offs on every message's path, one to start
the fsync (it waits for the event loop to let go of the GIL) and one to report it (the loop waits for
the thread's Python code). This thread never holds the GIL: it waits on a pthread condition, runs
`fdatasync`, records the recovery point and wakes each event loop through its eventfd, all in C.

Promises, the same as the Python thread's (flush.py): an offset is said synced only once an fdatasync
of every file that holds bytes before it succeeded; after one fsync fails no other runs, here or in
`sync_here`, and the failure is reported to every waiter; the recovery point written never exceeds
what an fsync covered. One round at a time, the thread's or a caller's (`sync_here`).
"""

from libc.errno cimport errno, EBADF, EINTR, EINVAL, ENOMEM
from libc.stdint cimport int64_t, uint64_t, uint8_t
from libc.stdlib cimport free, malloc
from posix.time cimport clock_gettime, nanosleep, timespec, CLOCK_MONOTONIC
from posix.unistd cimport fdatasync, pwrite, write


cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    int pthread_mutex_init(pthread_mutex_t*, void*)
    int pthread_mutex_destroy(pthread_mutex_t*)
    int pthread_mutex_lock(pthread_mutex_t*)
    int pthread_mutex_unlock(pthread_mutex_t*)
    int pthread_condattr_init(pthread_condattr_t*)
    int pthread_condattr_setclock(pthread_condattr_t*, int)
    int pthread_condattr_destroy(pthread_condattr_t*)
    int pthread_cond_init(pthread_cond_t*, pthread_condattr_t*)
    int pthread_cond_destroy(pthread_cond_t*)
    int pthread_cond_wait(pthread_cond_t*, pthread_mutex_t*)
    int pthread_cond_timedwait(pthread_cond_t*, pthread_mutex_t*, const timespec*)
    int pthread_cond_signal(pthread_cond_t*)
    int pthread_cond_broadcast(pthread_cond_t*)

cdef extern from "zlib.h" nogil:
    unsigned long zlib_crc32 "crc32"(unsigned long crc, const unsigned char* buf, unsigned int length)

cdef enum:
    MAX_LOOPS = 64  # event loops woken after each round
    DURATIONS = 256  # fsync times kept until collected (for the fsync-time histogram)


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef class SyncThread:
    """Shared state between the thread (`run`, on a thread of its own), the callers that ask for
    rounds (`ask`, `sync_here`), wait (`wait_synced`) or read what happened (`collect`)."""

    cdef pthread_mutex_t mu  # guards every field below but the round's own
    cdef pthread_mutex_t round_mu  # one round at a time
    cdef pthread_cond_t asked  # the thread waits on it for a request
    cdef pthread_cond_t done  # blocking callers wait on it for a round's end
    cdef int* fds  # the files of the latest request (malloc'd)
    cdef int nfds
    cdef uint64_t cut_epoch  # raised by `lower_point`: a request read before it is stale
    cdef bint is_shut  # `shut`: no round any more
    cdef int64_t requested  # the highest end asked for
    cdef int64_t synced  # every byte before it is fsynced
    cdef int failed  # errno of the failed fsync; 0 while none failed
    cdef bint syncing
    cdef bint stopping
    cdef int arrivals  # requests that came while a round ran
    cdef int siblings
    cdef int64_t window_ns
    cdef int64_t last_round_ns
    cdef int loops[MAX_LOOPS]  # eventfds
    cdef int nloops
    cdef uint64_t rounds
    cdef uint64_t here_rounds  # those run by `sync_here`
    cdef int64_t started_ns[DURATIONS]  # of the last rounds: when the fsync started (CLOCK_MONOTONIC)...
    cdef int64_t durations_ns[DURATIONS]  # ...and how long it took
    cdef uint64_t durations_seen  # rounds whose time `collect` has returned
    cdef int point_fd  # the recovery point's file (recovery_point.py), -1 for none
    cdef int64_t point  # the last point recorded
    cdef int point_errno  # the last failure to record it, 0 for none
    cdef int inject_errno  # tests: the next fsync fails with this errno

    def __cinit__(self, int64_t synced, int point_fd, double window_s, int siblings):
        cdef pthread_condattr_t attr
        pthread_mutex_init(&self.mu, NULL)
        pthread_mutex_init(&self.round_mu, NULL)
        pthread_condattr_init(&attr)
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        pthread_cond_init(&self.asked, &attr)
        pthread_cond_init(&self.done, &attr)
        pthread_condattr_destroy(&attr)
        self.requested = synced
        self.synced = synced
        self.point = -1
        self.point_fd = point_fd
        self.window_ns = <int64_t>(window_s * 1e9)
        self.siblings = siblings

    def __dealloc__(self):
        free(self.fds)
        pthread_cond_destroy(&self.asked)
        pthread_cond_destroy(&self.done)
        pthread_mutex_destroy(&self.mu)
        pthread_mutex_destroy(&self.round_mu)

    @property
    def epoch(self) -> int:
        """Read it before the files of a request: `ask` and `sync_here` refuse a request read
        before the log was cut back (`lower_point`), which could name an end that is gone."""
        return self.cut_epoch

    def ask(self, int64_t end, fds, uint64_t epoch) -> bool:
        """Ask for a round covering `end`, which lies in the files `fds` (their descriptors, the
        oldest first). False when the request is stale (`epoch`)."""
        return self._request(end, fds, epoch, True)

    cdef bint _request(self, int64_t end, fds, uint64_t epoch, bint wake) except -1:
        cdef int n = len(fds)
        cdef int i
        cdef bint fresh
        cdef int* files = <int*>malloc(max(n, 1) * sizeof(int))
        if files == NULL:
            raise MemoryError()
        for i in range(n):  # Python work before the lock: nothing that may let go of the GIL under it
            files[i] = fds[i]
        pthread_mutex_lock(&self.mu)
        fresh = epoch == self.cut_epoch
        if fresh and end > self.requested:
            self.requested = end
            files, self.fds = self.fds, files
            self.nfds = n
            self.arrivals += self.syncing
            if wake:
                pthread_cond_signal(&self.asked)
        pthread_mutex_unlock(&self.mu)
        free(files)  # the one not kept
        return fresh

    def run(self) -> None:
        """The thread's body: rounds until `stop` (or a failed fsync); returns without running one
        more (the caller's close does the last)."""
        with nogil:
            self._run()

    cdef void _run(self) noexcept nogil:
        cdef bint busy
        cdef int64_t since
        cdef timespec pause
        pthread_mutex_lock(&self.mu)
        while True:
            while self.requested <= self.synced and not self.stopping and self.failed == 0:
                pthread_cond_wait(&self.asked, &self.mu)
            if self.stopping or self.failed != 0:
                break
            busy = self.arrivals >= self.siblings
            self.arrivals = 0
            self.syncing = True
            pthread_mutex_unlock(&self.mu)
            # Under load, let more appends share the next fsync (flush.py, DEFAULT_COMMIT_WINDOW_MS).
            since = _now_ns() - self.last_round_ns
            if busy and since < self.window_ns:
                pause.tv_sec = (self.window_ns - since) // 1000000000
                pause.tv_nsec = (self.window_ns - since) % 1000000000
                nanosleep(&pause, NULL)
            self._round(False)
            pthread_mutex_lock(&self.mu)
            self.syncing = False
        pthread_mutex_unlock(&self.mu)

    def sync_here(self, int64_t end, fds, uint64_t epoch) -> bool:
        """One round on the calling thread, covering at least `end` in the files `fds` (GIL
        released). False when an fsync failed, this one or an earlier one, or the request is stale."""
        cdef bint ok
        if not self._request(end, fds, epoch, False):  # not the thread's to run
            return False
        with nogil:
            self._round(True)
            pthread_mutex_lock(&self.mu)
            ok = self.failed == 0 and self.synced >= end
            pthread_mutex_unlock(&self.mu)
        return ok

    cdef void _round(self, bint here) noexcept nogil:
        """fsync every file of the latest request, then say so: the recovery point first, then the
        synced end, then the waiters (the loops' eventfds and the blocking callers)."""
        cdef int* fds
        cdef int nfds, i, rc, failed = 0
        cdef int64_t end, started, took
        cdef uint64_t one = 1
        pthread_mutex_lock(&self.round_mu)
        pthread_mutex_lock(&self.mu)
        end = self.requested
        nfds = self.nfds
        # no fsync after a failed one, nor once shut; nothing new to cover
        if self.failed != 0 or self.is_shut or end <= self.synced:
            pthread_mutex_unlock(&self.mu)
            pthread_mutex_unlock(&self.round_mu)
            return
        fds = <int*>malloc(max(nfds, 1) * sizeof(int))
        if fds == NULL:
            nfds = 0
            failed = ENOMEM
        for i in range(nfds):
            fds[i] = self.fds[i]
        if failed == 0:
            failed, self.inject_errno = self.inject_errno, 0
        pthread_mutex_unlock(&self.mu)
        started = _now_ns()
        i = 0
        while failed == 0 and i < nfds:
            rc = fdatasync(fds[i])
            # EBADF, EINVAL (not a file: the number was reused): a segment closed since the request,
            # taken back or deleted, needs no fsync
            if rc == 0 or errno == EBADF or errno == EINVAL:
                i += 1
            elif errno != EINTR:
                failed = errno
        free(fds)
        took = _now_ns() - started
        if failed == 0:
            self._record_point(end)
        pthread_mutex_lock(&self.mu)
        self.last_round_ns = _now_ns()
        self.started_ns[self.rounds % DURATIONS] = started
        self.durations_ns[self.rounds % DURATIONS] = took
        self.rounds += 1
        self.here_rounds += here
        if failed != 0:
            self.failed = failed
        elif end > self.synced:
            self.synced = end
        for i in range(self.nloops):
            write(self.loops[i], &one, 8)
        pthread_cond_broadcast(&self.done)
        pthread_mutex_unlock(&self.mu)
        pthread_mutex_unlock(&self.round_mu)

    cdef void _record_point(self, int64_t end) noexcept nogil:
        """recovery_point.py's format: the offset (u64, big-endian), then the CRC-32 of those 8 bytes."""
        cdef uint8_t data[12]
        cdef unsigned long crc
        cdef int i
        if self.point_fd < 0:
            return
        for i in range(8):
            data[i] = (end >> (56 - 8 * i)) & 0xFF
        crc = zlib_crc32(0, data, 8)
        for i in range(4):
            data[8 + i] = (crc >> (24 - 8 * i)) & 0xFF
        if pwrite(self.point_fd, data, 12, 0) == 12:
            self.point = end
            self.point_errno = 0
        else:
            self.point_errno = errno

    def lower_point(self, int64_t end) -> None:
        """The log was cut back to `end` (a failed append taken back): nothing past it is synced,
        and the recovery point goes no further (after any round in progress)."""
        with nogil:
            pthread_mutex_lock(&self.round_mu)
            pthread_mutex_lock(&self.mu)
            self.cut_epoch += 1
            if self.synced > end:
                self.synced = end
            if self.requested > end:
                self.requested = end
            pthread_mutex_unlock(&self.mu)
            if self.point > end:
                self._record_point(end)
            pthread_mutex_unlock(&self.round_mu)

    def wait_synced(self, int64_t end, double timeout_s) -> bool:
        """Wait (GIL released) until `end` is synced or an fsync failed: True then; False when
        `timeout_s` passed first (a negative timeout waits for ever) or it was shut."""
        cdef timespec deadline
        cdef int64_t at
        cdef bint ok
        with nogil:
            at = _now_ns() + <int64_t>(timeout_s * 1e9)
            deadline.tv_sec = at // 1000000000
            deadline.tv_nsec = at % 1000000000
            pthread_mutex_lock(&self.mu)
            while self.synced < end and self.failed == 0 and not self.is_shut:
                if timeout_s < 0:
                    pthread_cond_wait(&self.done, &self.mu)
                elif pthread_cond_timedwait(&self.done, &self.mu, &deadline) != 0:
                    break
            ok = self.synced >= end or self.failed != 0
            pthread_mutex_unlock(&self.mu)
        return ok

    def collect(self) -> tuple:
        """(synced end, errno of the failed fsync or 0, rounds so far, those of them `sync_here` ran,
        (start, seconds) of each fsync since the last collect (at most the last 256; the start on
        CLOCK_MONOTONIC, as `time.perf_counter`), errno of the last failure to record the recovery
        point or 0)."""
        cdef int64_t started[DURATIONS]
        cdef int64_t took[DURATIONS]
        cdef int n = 0
        cdef uint64_t first, rounds, here
        cdef int64_t synced
        cdef int failed, point_errno
        pthread_mutex_lock(&self.mu)  # C only under the lock: building objects may let go of the GIL
        first = self.durations_seen
        if self.rounds - first > DURATIONS:
            first = self.rounds - DURATIONS
        while first < self.rounds:
            started[n] = self.started_ns[first % DURATIONS]
            took[n] = self.durations_ns[first % DURATIONS]
            n += 1
            first += 1
        self.durations_seen = self.rounds
        synced, failed, rounds, here, point_errno = (
            self.synced, self.failed, self.rounds, self.here_rounds, self.point_errno
        )
        pthread_mutex_unlock(&self.mu)
        durations = [(started[i] / 1e9, took[i] / 1e9) for i in range(n)]
        return synced, failed, rounds, here, durations, point_errno

    @property
    def synced_end(self) -> int:
        return self.synced

    @property
    def failed_errno(self) -> int:
        return self.failed

    def add_loop(self, int efd) -> None:
        """Write 1 to `efd` (an eventfd) after every round. Raises when MAX_LOOPS are registered."""
        pthread_mutex_lock(&self.mu)
        if self.nloops >= MAX_LOOPS:
            pthread_mutex_unlock(&self.mu)
            raise RuntimeError(f"more than {MAX_LOOPS} event loops wait on one store")
        self.loops[self.nloops] = efd
        self.nloops += 1
        pthread_mutex_unlock(&self.mu)

    def remove_loop(self, int efd) -> None:
        cdef int i
        pthread_mutex_lock(&self.mu)
        for i in range(self.nloops):
            if self.loops[i] == efd:
                self.loops[i] = self.loops[self.nloops - 1]
                self.nloops -= 1
                break
        pthread_mutex_unlock(&self.mu)

    def fail_next(self, int error_number) -> None:
        """Tests: the next round fails as if its fdatasync had returned `error_number`."""
        pthread_mutex_lock(&self.mu)
        self.inject_errno = error_number
        pthread_mutex_unlock(&self.mu)

    def shut(self) -> None:
        """No round any more, here or on the thread, and the recovery point's file is let go (after
        any round in progress): for the store's close."""
        with nogil:
            pthread_mutex_lock(&self.round_mu)
            pthread_mutex_lock(&self.mu)
            self.is_shut = True
            self.point_fd = -1
            pthread_cond_broadcast(&self.done)
            pthread_mutex_unlock(&self.mu)
            pthread_mutex_unlock(&self.round_mu)

    def stop(self) -> None:
        """End `run` once its round in progress is over (the thread is joined by the caller)."""
        pthread_mutex_lock(&self.mu)
        self.stopping = True
        pthread_cond_broadcast(&self.asked)
        pthread_cond_broadcast(&self.done)
        pthread_mutex_unlock(&self.mu)
