"""The pull log of one consumer in one group: the consume-log sequences it was handed, in order.

Pull sequence i (0, 1, 2, ...) is the i-th message this consumer received; the pull log maps it to the
consume-log sequence of that message. Acknowledgements are a prefix: `ack_seq` says every pull sequence
below it is done (QMQ's model: the client acks the contiguous completed prefix). What lies between
`ack_seq` and `pull_seq` was handed out and not yet acknowledged. Runs of consecutive sequences are
stored as one (first pull seq, first consume-log seq, count), so a backlog read in batches costs a
few tuples, not an entry per message. Nothing here does I/O.
"""

from __future__ import annotations

import bisect


class PullLog:
    def __init__(self) -> None:
        self._firsts: list[int] = []  # first pull seq of each run, ascending (for bisect)
        self._runs: list[tuple[int, int, int]] = []  # (first pull seq, first consume-log seq, count)
        self.pull_seq = 0  # the next pull sequence to hand out
        self.ack_seq = 0  # every pull sequence below this is acknowledged

    @property
    def unacked(self) -> int:
        return self.pull_seq - self.ack_seq

    def append(self, seqs: list[int]) -> int:
        """Record that `seqs` (ascending consume-log sequences) were handed out; returns the pull
        sequence of the first."""
        first_pull = self.pull_seq
        for seq in seqs:
            if self._runs:
                p, s, n = self._runs[-1]
                if p + n == self.pull_seq and s + n == seq:
                    self._runs[-1] = (p, s, n + 1)
                    self.pull_seq += 1
                    continue
            self._runs.append((self.pull_seq, seq, 1))
            self._firsts.append(self.pull_seq)
            self.pull_seq += 1
        return first_pull

    def lookup(self, first_pull: int, last_pull: int) -> list[int]:
        """Consume-log sequences of pull sequences `first_pull..last_pull` (inclusive)."""
        out: list[int] = []
        i = max(0, bisect.bisect_right(self._firsts, first_pull) - 1)
        while i < len(self._runs) and first_pull <= last_pull:
            p, s, n = self._runs[i]
            if first_pull < p:
                raise KeyError(f"pull sequence {first_pull} was trimmed")
            if first_pull < p + n:
                end = min(last_pull, p + n - 1)
                out.extend(range(s + first_pull - p, s + end - p + 1))
                first_pull = end + 1
            i += 1
        if first_pull <= last_pull:
            raise KeyError(f"pull sequence {first_pull} was never handed out (pull_seq {self.pull_seq})")
        return out

    def ack(self, last_pull: int) -> bool:
        """Acknowledge every pull sequence up to `last_pull`; False if that changes nothing (a repeat)."""
        if last_pull >= self.pull_seq:
            raise ValueError(f"ack of pull sequence {last_pull}, but only {self.pull_seq} were handed out")
        if last_pull < self.ack_seq:
            return False
        self.ack_seq = last_pull + 1
        self._trim()
        return True

    def _trim(self) -> None:
        """Forget runs wholly acknowledged; they are never looked up again."""
        drop = 0
        while drop < len(self._runs) and self._runs[drop][0] + self._runs[drop][2] <= self.ack_seq:
            drop += 1
        if drop:
            del self._runs[:drop]
            del self._firsts[:drop]

    def to_state(self) -> list:
        """A msgpack-able copy, for snapshots."""
        return [self.pull_seq, self.ack_seq, [list(run) for run in self._runs]]

    @classmethod
    def from_state(cls, state: list) -> PullLog:
        log = cls()
        log.pull_seq, log.ack_seq = int(state[0]), int(state[1])
        log._runs = [(int(p), int(s), int(n)) for p, s, n in state[2]]
        log._firsts = [run[0] for run in log._runs]
        return log

    def pending(self) -> list[int]:
        """Consume-log sequences handed out and not acknowledged, in pull order."""
        return self.lookup(self.ack_seq, self.pull_seq - 1) if self.unacked else []
