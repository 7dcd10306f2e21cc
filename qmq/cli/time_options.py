"""Times and durations on the command line (`qmq ledger export`, `qmq reconcile`, `qmq console`): click
types over `qmq.times`, whose errors name the accepted forms."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import click

from qmq.times import TIME_FORMS, parse_duration, parse_time

__all__ = ["DURATION", "TIME", "TIME_FORMS", "Parsed", "parse_duration", "parse_time"]


class Parsed(click.ParamType):
    """A click type from a parse function whose ValueError says what to type instead."""

    def __init__(self, name: str, parse: Callable[[str], Any], kind: type) -> None:
        self.name, self.parse, self.kind = name, parse, kind

    def convert(self, value, param, ctx):
        if isinstance(value, self.kind):
            return value
        try:
            return self.parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


TIME = Parsed("TIME", parse_time, datetime)
DURATION = Parsed("DURATION", parse_duration, timedelta)
