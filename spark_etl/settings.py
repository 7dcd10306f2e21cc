"""What one reconciliation run is asked to do: the sources, the window, the grace period, the
thresholds and the repairs. Built by the command line (`qmq reconcile`, `spark-submit
spark_etl/reconcile.py`) or by a caller; nothing here touches Spark."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

DEFAULT_GRACE = timedelta(minutes=15)
# Outbox rows are read this far beyond the window on both sides, so that a message whose clocks
# disagree a little (the producer's id, the database's created_at, the broker's store time) is matched
# rather than reported; a transaction open longer than this may be misplaced by a day.
DEFAULT_SKEW = timedelta(hours=1)
DEFAULT_JDBC_PARTITIONS = 4  # also the most connections opened to one database at once
THRESHOLD_RE = re.compile(r"(\d+(?:\.\d+)?)(%?)")


@dataclass(frozen=True)
class Threshold:
    """At most `count` messages, or at most `percent` of the window's messages."""

    count: int | None = None
    percent: float | None = None

    @classmethod
    def parse(cls, text: str) -> Threshold:
        match = THRESHOLD_RE.fullmatch(text.strip())
        if not match:
            raise ValueError(f"{text!r} is not a threshold: give a count (10) or a percentage (0.01%)")
        number, percent = match.groups()
        if percent:
            return cls(percent=float(number))
        if "." in number:
            raise ValueError(f"{text!r}: a count is a whole number (or add % for a percentage)")
        return cls(count=int(number))

    def limit(self, total: int) -> float:
        return float(self.count) if self.count is not None else total * (self.percent or 0.0) / 100

    def exceeded(self, found: int, total: int) -> bool:
        return found > self.limit(total)

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent is not None else str(self.count)


@dataclass
class Settings:
    outbox_dbs: list[str]
    ledger: Path
    out: Path
    since: datetime
    until: datetime
    grace: timedelta = DEFAULT_GRACE
    consumed_dbs: list[str] = field(default_factory=list)
    max_not_shipped: Threshold = field(default_factory=lambda: Threshold(count=0))
    max_not_acked: Threshold = field(default_factory=lambda: Threshold(count=0))
    ignore_groups: list[str] = field(default_factory=list)  # retired groups: not expected to ack
    redrive: bool = False  # not_shipped outbox rows back to pending
    redrive_dead: bool = False  # dead letters of the window's (subject, group)s back to their groups
    brokers: list[str] = field(default_factory=list)  # where to re-drive dead letters...
    meta: str | None = None  # ...or the meta server that knows
    skew: timedelta = DEFAULT_SKEW
    jdbc_partitions: int = DEFAULT_JDBC_PARTITIONS

    def check(self) -> None:
        """ValueError naming what is wrong."""
        if not self.outbox_dbs:
            raise ValueError("give at least one --outbox-db")
        if self.since >= self.until:
            raise ValueError(f"--since ({self.since.isoformat()}) must be before --until ({self.until.isoformat()})")
        if self.grace < timedelta(0):
            raise ValueError("--grace must not be negative")
        if self.redrive_dead and not (self.brokers or self.meta):
            raise ValueError("--redrive-dead needs the brokers: --broker H:P (repeat) or --meta H:P")
        if self.jdbc_partitions < 1:
            raise ValueError("--jdbc-partitions must be at least 1")
