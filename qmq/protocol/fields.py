"""Checks of the fields of a request body, shared by every server: each returns the field's value or
raises a non-fatal BAD_REQUEST `ProtocolError` that names the field and says what it must be, so a
client learns what to fix and its connection stays usable. No I/O.

Names, subjects and message contents have their own checks in `limits.py`.
"""

from __future__ import annotations

from typing import Any

from qmq.protocol.errors import ErrorCode, ProtocolError

REQUIRED: Any = object()  # the default of a field that must be present

_WHAT = {int: "an integer", str: "a string", bool: "a boolean", list: "a list", dict: "a map", bytes: "bytes"}


def bad(message: str) -> ProtocolError:
    """A BAD_REQUEST answer that leaves the connection open."""
    return ProtocolError(ErrorCode.BAD_REQUEST, message, fatal=False)


def body_of(body: object) -> dict[str, Any]:
    """A request's body as a map (an absent body is an empty one); BAD_BODY otherwise."""
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_BODY, f"the body must be a map, not {type(body).__name__}", fatal=False)
    return body


def field(body: dict[str, Any], name: str, type_: type, default: Any = REQUIRED, what: str = "") -> Any:
    """`body[name]` if it has type `type_` (a bool is not an int), `default` when absent. `what`
    describes the value in the error, by default its type."""
    value = body.get(name, default)
    if value is REQUIRED:
        raise bad(f"missing field {name!r}" + (f" ({what})" if what else ""))
    if value is not default and (type(value) is not type_ and not _instance(value, type_)):
        raise bad(f"field {name!r} must be {what or _WHAT.get(type_, type_.__name__)}, got {type(value).__name__}")
    return value


def int_field(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    """`body[name]`, an integer from `low` to `high`, `default` when absent."""
    value = field(body, name, int, default)
    if not low <= value <= high:
        raise bad(f"field {name!r} must be {low}-{high}, got {value}")
    return value


def choice_field(body: dict[str, Any], name: str, choices: tuple[str, ...], default: str = REQUIRED) -> str:
    """`body[name]`, one of `choices`, `default` when absent."""
    value = field(body, name, str, default, what=_one_of(choices))
    if value not in choices:
        raise bad(f"field {name!r} must be {_one_of(choices)}, got {value!r}")
    return value


def _instance(value: Any, type_: type) -> bool:
    return isinstance(value, type_) and not (type_ is int and isinstance(value, bool))


def _one_of(choices: tuple[str, ...]) -> str:
    return "one of " + ", ".join(repr(c) for c in choices)
