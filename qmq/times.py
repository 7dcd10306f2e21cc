"""Times and durations as people type them (command line, console): aware UTC datetimes and
timedeltas, with an error naming the accepted forms. No I/O.

A time is an ISO 8601 date (`2026-11-20`: midnight UTC) or date and time (`2026-11-20T06:30`,
`...+01:00`, `...Z`; no zone means UTC), or `now`, `today`, `yesterday` (midnights, UTC). A duration
is a number with a unit, or several (`90s`, `15m`, `2h`, `1d`, `1h30m`, `500ms`); a bare number is
seconds.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
TIME_FORMS = "an ISO 8601 date or date-time (UTC unless it has a zone), 'now', 'today' or 'yesterday'"


def midnight(moment: datetime) -> datetime:
    """The start of `moment`'s UTC day."""
    return moment.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def parse_time(text: str, now: datetime | None = None) -> datetime:
    """An aware UTC datetime; ValueError naming the accepted forms."""
    now = now or datetime.now(UTC)
    word = text.strip().lower()
    if word == "now":
        return now
    if word == "today":
        return midnight(now)
    if word == "yesterday":
        return midnight(now) - timedelta(days=1)
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a time: give {TIME_FORMS}") from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def parse_duration(text: str) -> timedelta:
    """A timedelta from `15m`, `1h30m`, `90` (seconds)...; ValueError for anything else."""
    cleaned = text.strip().lower()
    try:
        return timedelta(seconds=float(cleaned))
    except ValueError:
        pass
    parts = DURATION_PART.findall(cleaned)
    if not parts or "".join(n + u for n, u in parts) != cleaned:
        raise ValueError(
            f"{text!r} is not a duration: give a number with a unit (500ms, 90s, 15m, 2h, 1d) or several (1h30m)"
        )
    return timedelta(seconds=sum(float(n) * UNIT_SECONDS[u] for n, u in parts))
