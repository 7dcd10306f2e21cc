"""Frames and the decoder: round trips, every rejection rule, and property tests that feed thousands of
random and mutated byte streams to the decoder and to both roles of the connection state machine.
The promise under test: each input gives valid frames/events, NEED_DATA or a ProtocolError, never
another exception, and a decoding loop always ends."""

from __future__ import annotations

import itertools
import os
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from qmq.protocol.codes import RequestCode
from qmq.protocol.connection import (
    NEED_DATA,
    Connection,
    ErrorReply,
    HandshakeAccepted,
    Request,
    Response,
    Role,
)
from qmq.protocol.errors import ErrorCode, ProtocolError
from qmq.protocol.frame import (
    HEADER,
    HEADER_BYTES,
    LENGTH,
    LENGTH_BYTES,
    PROTOCOL_VERSION,
    REQUEST,
    VALID_FLAG_SETS,
    Flags,
    Frame,
    FrameDecoder,
    encode_frame,
)
from qmq.protocol.limits import Limits

SMALL = Limits(max_frame_bytes=4096)  # small, so random lengths often land on both sides of it
# Examples per fuzz test: bounded for CI on a 2-core machine (these tests were a fifth of its CPU at
# 2,000); a deeper run: QMQ_FUZZ_EXAMPLES=5000 pytest tests/test_protocol_frames.py
FUZZ_EXAMPLES = int(os.environ.get("QMQ_FUZZ_EXAMPLES", "600"))
MANY = settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOME = settings(max_examples=300, deadline=None)

# -- strategies ---------------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=6,
)
bodies = st.none() | st.dictionaries(st.text(max_size=10), values, max_size=4)
codes = st.integers(0, 0xFFFF)
request_ids = st.integers(0, 0xFFFF_FFFF)
flag_sets = st.sampled_from(sorted(VALID_FLAG_SETS))


@st.composite
def frames(draw) -> Frame:
    return Frame(draw(codes), draw(request_ids), draw(flag_sets), draw(bodies))


def encode(frame: Frame) -> bytes:
    """A frame's bytes, whatever its size (the decoder under test may still refuse it)."""
    return encode_frame(frame.code, frame.request_id, frame.body, frame.flags, limits=Limits(2**32 - 1))


@st.composite
def chunked(draw, data: bytes) -> list[bytes]:
    """`data` cut into pieces at random points, as a socket might deliver it."""
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=8)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """`data` after a few random edits: flipped or replaced bytes, cuts, insertions, splices."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "splice", "repeat"]))
        pos = draw(st.integers(0, len(data)))
        if kind == "flip" and pos < len(data):
            data[pos] ^= draw(st.integers(1, 255))
        elif kind == "set" and pos < len(data):
            data[pos] = draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xC1, 0xDC, 0xDF, 0xFF]))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[pos : pos + draw(st.integers(1, 16))]
        elif kind == "splice":
            other = encode(draw(frames()))
            data[pos:] = other[draw(st.integers(0, len(other))) :]
        elif kind == "repeat":
            data += data[pos:]
    return bytes(data)


# -- helpers ------------------------------------------------------------------------------------------


def drain_decoder(decoder: FrameDecoder, max_frames: int) -> tuple[list[Frame], ProtocolError | None]:
    """All frames the decoder yields, and the ProtocolError that stopped it, if any. Fails if the
    decoder yields more frames than the input could hold (which would mean a loop that never ends)."""
    out: list[Frame] = []
    try:
        while (frame := decoder.next_frame()) is not None:
            out.append(frame)
            assert len(out) <= max_frames, "decoder yields frames out of nothing"
    except ProtocolError as exc:
        return out, exc
    return out, None


def assert_valid_frame(frame: Frame) -> None:
    assert isinstance(frame, Frame)
    assert frame.version == PROTOCOL_VERSION
    assert 0 <= frame.code <= 0xFFFF and 0 <= frame.request_id <= 0xFFFF_FFFF
    assert frame.flags in VALID_FLAG_SETS
    assert frame.body is None or isinstance(frame.body, dict)


def feed_all(decoder: FrameDecoder, chunks: list[bytes]) -> tuple[list[Frame], ProtocolError | None]:
    """Feed a decoder chunk by chunk, checking every frame; stop at the first ProtocolError."""
    frames_out: list[Frame] = []
    total = sum(len(c) for c in chunks)
    for chunk in chunks:
        decoder.feed(chunk)
        got, error = drain_decoder(decoder, total // (LENGTH_BYTES + HEADER_BYTES) + 1)
        frames_out += got
        for frame in got:
            assert_valid_frame(frame)
        if error is not None:
            assert isinstance(error.code, ErrorCode) and error.fatal
            event(f"stopped by {error.code.name}")  # shown by --hypothesis-show-statistics
            return frames_out, error
    event("clean" if frames_out else "clean, no frame")
    return frames_out, None


def raw_frame(length: int | None, version: int, code: int, request_id: int, flags: int, payload: bytes) -> bytes:
    header = HEADER.pack(version, code, request_id, flags)
    if length is None:
        length = len(header) + len(payload)
    return LENGTH.pack(length) + header + payload


def decode_one(data: bytes, limits: Limits = SMALL) -> Frame | None:
    decoder = FrameDecoder(limits)
    decoder.feed(data)
    return decoder.next_frame()


# -- round trips --------------------------------------------------------------------------------------


@settings(MANY, max_examples=max(1, FUZZ_EXAMPLES // 2))
@given(st.data(), st.lists(frames(), min_size=1, max_size=5))
def test_frames_round_trip_whatever_the_chunking(data, sent: list[Frame]) -> None:
    stream = b"".join(encode(frame) for frame in sent)
    decoder = FrameDecoder(Limits(max_frame_bytes=2**32 - 1))
    received, error = feed_all(decoder, data.draw(chunked(stream)))
    assert error is None
    assert received == sent
    assert decoder.buffered_bytes == 0


def test_layout_is_length_then_header_then_msgpack() -> None:
    data = encode_frame(RequestCode.PING, 7, {"a": 1}, Flags.ONEWAY)
    payload = msgpack.packb({"a": 1})
    assert data == struct.pack(">IBHIH", HEADER_BYTES + len(payload), 1, 2, 7, 4) + payload
    assert decode_one(data) == Frame(RequestCode.PING, 7, Flags.ONEWAY, {"a": 1})
    assert decode_one(encode_frame(1, 1)) == Frame(1, 1, REQUEST, None)


def test_encode_refuses_what_it_cannot_send() -> None:
    with pytest.raises(ProtocolError) as info:
        encode_frame(2, 1, {"x": b"x" * 5000}, limits=SMALL)
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE and not info.value.fatal
    for bad in [dict(code=-1), dict(code=70000), dict(request_id=2**32), dict(flags=Flags.ERROR)]:
        with pytest.raises(ValueError):
            encode_frame(**{"code": 2, "request_id": 1, **bad})
    with pytest.raises(ValueError):
        encode_frame(2, 1, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode_frame(2, 1, {"x": object()})


# -- every rejection rule -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (raw_frame(3, 1, 2, 1, 0, b""), ErrorCode.BAD_FRAME),  # length shorter than the header
        (raw_frame(0, 1, 2, 1, 0, b""), ErrorCode.BAD_FRAME),
        (raw_frame(None, 2, 2, 1, 0, b"\xc0"), ErrorCode.UNSUPPORTED_VERSION),
        (raw_frame(None, 0, 2, 1, 0, b"\xc0"), ErrorCode.UNSUPPORTED_VERSION),
        (raw_frame(None, 1, 2, 1, 8, b"\xc0"), ErrorCode.BAD_FRAME),  # undefined flag bit
        (raw_frame(None, 1, 2, 1, 0x8000, b"\xc0"), ErrorCode.BAD_FRAME),
        (raw_frame(None, 1, 2, 1, int(Flags.ERROR), b"\xc0"), ErrorCode.BAD_FRAME),  # ERROR without RESPONSE
        (raw_frame(None, 1, 2, 1, int(Flags.RESPONSE | Flags.ONEWAY), b"\xc0"), ErrorCode.BAD_FRAME),
        (raw_frame(None, 1, 2, 1, 0, b""), ErrorCode.BAD_BODY),  # no body at all
        (raw_frame(None, 1, 2, 1, 0, b"\xc1"), ErrorCode.BAD_BODY),  # never-used msgpack byte
        (raw_frame(None, 1, 2, 1, 0, b"\x81\xa1a"), ErrorCode.BAD_BODY),  # map cut short
        (raw_frame(None, 1, 2, 1, 0, b"\xc0\xc0"), ErrorCode.BAD_BODY),  # extra data after the body
        (raw_frame(None, 1, 2, 1, 0, msgpack.packb([1, 2])), ErrorCode.BAD_BODY),  # not a map
        (raw_frame(None, 1, 2, 1, 0, msgpack.packb("text")), ErrorCode.BAD_BODY),
        (raw_frame(None, 1, 2, 1, 0, msgpack.packb({1: 2})), ErrorCode.BAD_BODY),  # non-string key
        (raw_frame(None, 1, 2, 1, 0, b"\x81\xa1a\xd4\x05\x01"), ErrorCode.BAD_BODY),  # extension type
        (raw_frame(None, 1, 2, 1, 0, b"\x81\xa1a\xa2\xff\xfe"), ErrorCode.BAD_BODY),  # not UTF-8
        (raw_frame(None, 1, 2, 1, 0, b"\x81\xa1a" + b"\x91" * 3000 + b"\xc0"), ErrorCode.BAD_BODY),  # too deep
        (raw_frame(None, 1, 2, 1, 0, b"\x81\xa1a\xdd\xff\xff\xff\xff"), ErrorCode.BAD_BODY),  # huge array
    ],
)
def test_bad_frames_are_refused_with_their_code(data: bytes, code: ErrorCode) -> None:
    decoder = FrameDecoder(SMALL)
    decoder.feed(data)
    with pytest.raises(ProtocolError) as info:
        decoder.next_frame()
    assert info.value.code == code and info.value.fatal
    with pytest.raises(ProtocolError) as again:  # broken for good, never silently resynchronised
        decoder.feed(encode_frame(2, 1))
        decoder.next_frame()
    assert again.value is info.value


@SOME
@given(st.integers(SMALL.max_frame_bytes + 1, 2**32 - 1))
def test_an_oversized_length_is_refused_before_any_body_arrives(length: int) -> None:
    decoder = FrameDecoder(SMALL)
    decoder.feed(LENGTH.pack(length))  # the four length bytes alone are enough to refuse
    with pytest.raises(ProtocolError) as info:
        decoder.next_frame()
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    decoder.feed(b"\x00" * 100_000)  # and what follows is not kept
    assert decoder.buffered_bytes == 0


def test_the_limit_itself_is_allowed() -> None:
    payload_len = SMALL.max_frame_bytes - HEADER_BYTES
    overhead = len(msgpack.packb({"b": b"x" * 300})) - 300  # a map of one bin16 value
    body = {"b": b"x" * (payload_len - overhead)}
    data = encode_frame(2, 1, body, limits=SMALL)
    assert len(data) == LENGTH_BYTES + SMALL.max_frame_bytes
    assert decode_one(data) == Frame(2, 1, REQUEST, body)


def test_a_bad_header_is_refused_before_the_body_arrives() -> None:
    decoder = FrameDecoder(SMALL)
    decoder.feed(raw_frame(4000, 9, 2, 1, 0, b""))
    with pytest.raises(ProtocolError) as info:
        decoder.next_frame()
    assert info.value.code == ErrorCode.UNSUPPORTED_VERSION


def test_partial_frames_wait_for_more() -> None:
    data = encode_frame(2, 1, {"a": "b"})
    decoder = FrameDecoder(SMALL)
    for byte in data[:-1]:
        decoder.feed(bytes([byte]))
        assert decoder.next_frame() is None
    decoder.feed(data[-1:])
    assert decoder.next_frame() == Frame(2, 1, REQUEST, {"a": "b"})
    assert decoder.next_frame() is None


# -- property tests: arbitrary input never crashes or hangs -----------------------------------------------


random_streams = st.binary(max_size=3000) | st.binary(max_size=200).map(  # random bodies behind good headers
    lambda payload: raw_frame(None, PROTOCOL_VERSION, RequestCode.PING, 1, 0, payload)
)


@MANY
@given(random_streams, st.data())
def test_random_bytes_give_frames_or_a_protocol_error(blob: bytes, data) -> None:
    feed_all(FrameDecoder(SMALL), data.draw(chunked(blob)))


@MANY
@given(st.lists(frames(), min_size=1, max_size=3), st.data())
def test_mutated_frames_give_frames_or_a_protocol_error(sent: list[Frame], data) -> None:
    stream = data.draw(mutated(b"".join(encode(frame) for frame in sent)))
    feed_all(FrameDecoder(SMALL), data.draw(chunked(stream)))


@MANY
@given(
    st.sampled_from([None, "secret"]),
    st.sampled_from([None, "secret", "wrong"]),
    st.lists(frames(), max_size=3),
    st.booleans(),
    st.data(),
)
def test_a_server_connection_survives_anything_a_client_sends(
    server_token, client_token, sent: list[Frame], mutate: bool, data
) -> None:
    client = Connection(Role.CLIENT, limits=SMALL, token=client_token, client_id="fuzz")
    stream = client.start_handshake()[1] + b"".join(encode(frame) for frame in sent)
    if mutate:
        stream = data.draw(mutated(stream))
    server = Connection(Role.SERVER, limits=SMALL, token=server_token)
    events = run_connection(server, data.draw(chunked(stream)), len(stream))
    for item in events:
        assert isinstance(item, Request | HandshakeAccepted)
    if events:
        assert isinstance(events[0], HandshakeAccepted)  # nothing is served before a good handshake
        assert server_token is None or client_token == server_token


@MANY
@given(st.lists(frames(), max_size=3), st.booleans(), st.data())
def test_a_client_connection_survives_anything_a_server_sends(sent: list[Frame], mutate: bool, data) -> None:
    client = Connection(Role.CLIENT, limits=SMALL, client_id="fuzz")
    client.start_handshake()
    for _ in range(3):
        client.send_request(RequestCode.PING, {})
    server = Connection(Role.SERVER, limits=SMALL)
    stream = b"".join(
        [server.send_response(1, 1, {"version": 1}), server.send_error(2, ErrorCode.BAD_REQUEST, "no")]
        + [encode(frame) for frame in sent]
    )
    if mutate:
        stream = data.draw(mutated(stream))
    for item in run_connection(client, data.draw(chunked(stream)), len(stream)):
        assert isinstance(item, Response | ErrorReply)
        assert isinstance(item.request_id, int)


def run_connection(conn: Connection, chunks: list[bytes], total: int) -> list:
    """Feed a connection chunk by chunk; return its events, stopping at the first ProtocolError."""
    events: list = []
    for chunk in chunks:
        conn.receive_data(chunk)
        try:
            while (item := conn.next_event()) is not NEED_DATA:
                events.append(item)
                assert len(events) <= total // (LENGTH_BYTES + HEADER_BYTES) + 1
        except ProtocolError as exc:
            assert isinstance(exc.code, ErrorCode)
            event(f"stopped by {exc.code.name} after {len(events)} events")
            with pytest.raises(ProtocolError):
                conn.next_event()
            return events
    event(f"clean, {len(events)} events")
    return events
