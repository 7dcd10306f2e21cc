"""Where an operator moves a consumer group (`qmq admin reset --to`, `group create --from`, the
console's reset form): "earliest", "latest", a consume-log sequence, or a time (the first message
stored at or after it), as the broker's request fields."""

from __future__ import annotations

from qmq.times import TIME_FORMS, parse_time

POSITION_FORMS = f"earliest, latest, a sequence number, or a time ({TIME_FORMS}): the first message stored then"


def parse_position(text: str) -> tuple[str | int, int | None]:
    """(to, time_ms) for BROKER_RESET and BROKER_GROUP_CREATE; ValueError naming the forms."""
    word = text.strip().lower()
    if word in ("earliest", "latest"):
        return word, None
    if word.isdigit():
        return int(word), None
    try:
        return "latest", int(parse_time(text).timestamp() * 1000)
    except ValueError:
        raise ValueError(f"{text!r} is not a position: give {POSITION_FORMS}") from None
