"""Message bodies as producers and clients encode them: bytes as they are, str as UTF-8 text, anything else as
JSON. Beyond what `json` knows, datetimes, dates and times (ISO 8601), Decimals (as strings, so no
digit is lost) and UUIDs are encoded by default, as Celery's and Django's JSON encoders do; an
application adds its own types with an encoder hook. NaN and infinities are refused: they are not
JSON, and a consumer in another language could not read them.
"""

from __future__ import annotations

import datetime
import decimal
import json
import uuid
from collections.abc import Callable
from typing import Any

BYTES = "application/octet-stream"
TEXT = "text/plain; charset=utf-8"
JSON = "application/json"

Encoder = type[json.JSONEncoder] | Callable[[Any], Any]  # a JSONEncoder subclass, or a `default(obj)` callable


class QmqJSONEncoder(json.JSONEncoder):
    """The default encoder: datetime, date and time as ISO 8601, Decimal as a string, UUID as a string."""

    def default(self, o: Any) -> Any:
        if isinstance(o, datetime.datetime | datetime.date | datetime.time):
            return o.isoformat()
        if isinstance(o, decimal.Decimal | uuid.UUID):
            return str(o)
        return super().default(o)


def _with_default(default: Callable[[Any], Any]) -> type[json.JSONEncoder]:
    """A QmqJSONEncoder that hands what it does not know to `default` (which, as `json.dumps`'s
    `default`, returns something JSON can encode or raises TypeError)."""

    class Encoder(QmqJSONEncoder):
        def default(self, o: Any) -> Any:
            try:
                return super().default(o)
            except TypeError:
                return default(o)

    return Encoder


def encoder_class(encoder: Encoder | None) -> type[json.JSONEncoder]:
    """The JSONEncoder class for an encoder hook (None: the default)."""
    if encoder is None:
        return QmqJSONEncoder
    if isinstance(encoder, type) and issubclass(encoder, json.JSONEncoder):
        return encoder
    if callable(encoder):
        return _with_default(encoder)
    raise TypeError(f"encoder must be a json.JSONEncoder subclass or a callable, not {encoder!r}")


def encode(body: Any, encoder: type[json.JSONEncoder] = QmqJSONEncoder) -> tuple[bytes, str]:
    """The bytes and content type of a body. TypeError for a value JSON cannot encode, ValueError for
    NaN or an infinity."""
    if type(body) is bytes:  # the common case first: a check per message sent
        return body, BYTES
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body), BYTES
    if isinstance(body, str):
        return body.encode(), TEXT
    try:
        text = json.dumps(body, cls=encoder, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except TypeError as exc:
        raise TypeError(
            f"a message body must be bytes, str or JSON-serialisable: {exc} (give the Producer encoder= "
            "for your own types)"
        ) from None
    except ValueError as exc:
        if "JSON compliant" not in str(exc):
            raise
        raise ValueError(
            "a message body may not contain NaN or an infinity: JSON has no such numbers (send None or a string)"
        ) from None
    return text.encode(), JSON
