"""The envelope: what a qmq client puts in a message's payload, which brokers store without reading.

It carries the body with its content type, the producer's headers and the creation time, so that a
consumer gets back the object that was sent. Bodies are bytes (`application/octet-stream`), str
(`text/plain; charset=utf-8`) or anything JSON can encode (`application/json`). A payload that is not
an envelope (sent by a foreign client) decodes as raw bytes. Nothing here does I/O.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import msgpack

from qmq.protocol.bodies import BYTES, JSON
from qmq.protocol.bodies import encode as encode_body
from qmq.protocol.packing import pack

MARKER = "qmq1"  # the envelope's format version, under key "v"
# The header naming who produced a message; an outbox names itself "outbox:<database>", which lets the
# reconciliation tell a rolled-back transaction's message from one sent outside any transaction.
PRODUCER_HEADER = "qmq-producer"
_unpackb = msgpack.unpackb
_new_tuple = tuple.__new__


class Envelope(NamedTuple):
    body: Any  # decoded by content type
    content_type: str
    headers: dict[str, str]
    created_at: int | None  # ms since the epoch, by the producer's clock
    raw: bytes  # the body's bytes as sent


def decode_body(raw: bytes, content_type: str) -> Any:
    if content_type == JSON:
        return json.loads(raw)
    if content_type.startswith("text/"):
        return raw.decode()
    return raw


def encode(
    body: Any, *, headers: dict[str, str] | None = None, created_at: int | None = None, content_type: str | None = None
) -> bytes:
    """The payload for a message. `content_type` given means `body` is already bytes of that type."""
    if content_type is None:
        raw, content_type = (body, BYTES) if type(body) is bytes else encode_body(body)  # bytes: most sends
    else:
        raw = bytes(body)
    envelope = {"v": MARKER, "b": raw, "ct": content_type, "t": created_at}
    if headers:
        envelope["h"] = {str(k): str(v) for k, v in headers.items()}
    return pack(envelope)


def decode(payload: bytes) -> Envelope:
    """The envelope in a payload; a payload that is not one comes back as bytes. (Run once per message
    a consumer receives: plain type checks, msgpack gives plain dicts.)"""
    try:
        envelope = _unpackb(payload, raw=False)
    except Exception:
        envelope = None
    if type(envelope) is not dict or envelope.get("v") != MARKER or type(raw := envelope.get("b")) is not bytes:
        return Envelope(payload, BYTES, {}, None, payload)
    content_type = envelope.get("ct") or BYTES
    if content_type == BYTES:
        body = raw
    else:
        try:
            body = decode_body(raw, content_type)
        except (ValueError, UnicodeDecodeError):
            body, content_type = raw, BYTES
    headers = envelope.get("h")
    # tuple.__new__: the named tuple's own __new__ is a Python function, a tenth of a consumer's time
    return _new_tuple(Envelope, (body, content_type, headers if type(headers) is dict else {}, envelope.get("t"), raw))
