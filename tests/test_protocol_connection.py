"""The connection state machine, both roles wired back to back in memory: handshake and token rules,
pipelining with replies out of order, request ids, and what each kind of misbehaviour raises."""

from __future__ import annotations

import pytest

from qmq.protocol.codes import RequestCode
from qmq.protocol.connection import (
    MAX_ERROR_MESSAGE_LEN,
    NEED_DATA,
    Connection,
    ErrorReply,
    HandshakeAccepted,
    Request,
    Response,
    Role,
)
from qmq.protocol.errors import ErrorCode, ProtocolError
from qmq.protocol.frame import MAX_REQUEST_ID, PROTOCOL_VERSION, REQUEST, Flags, encode_frame
from qmq.protocol.limits import Limits


def events(conn: Connection, data: bytes = b"") -> list:
    conn.receive_data(data)
    out = []
    while (event := conn.next_event()) is not NEED_DATA:
        out.append(event)
    return out


def refusal(conn: Connection, data: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        events(conn, data)
    with pytest.raises(ProtocolError) as again:  # a broken connection stays broken
        conn.next_event()
    assert again.value is info.value
    return info.value


def handshake_frame(body: dict | None) -> bytes:
    return encode_frame(RequestCode.HANDSHAKE, 1, body)


def test_pipelined_requests_before_the_handshake_reply_and_replies_out_of_order() -> None:
    client = Connection(Role.CLIENT, client_id="app-1", token="t")
    server = Connection(Role.SERVER, token="t")
    hs_id, data = client.start_handshake()
    sent = [client.send_request(RequestCode.PING, {"n": n}) for n in range(3)]
    data += b"".join(chunk for _, chunk in sent)

    accepted, *requests = events(server, data)
    assert isinstance(accepted, HandshakeAccepted) and accepted.client_id == "app-1"
    assert server.handshake_done
    assert requests == [Request(rid, RequestCode.PING, {"n": n}) for n, (rid, _) in enumerate(sent)]
    assert len({hs_id, *(rid for rid, _ in sent)}) == 4 and 0 not in {rid for rid, _ in sent}

    replies = accepted.reply + b"".join(
        server.send_response(r.request_id, r.code, {"echo": r.body["n"]}) for r in reversed(requests)
    )
    got = events(client, replies)
    assert got[0] == Response(hs_id, RequestCode.HANDSHAKE, {"version": PROTOCOL_VERSION, "max_frame_bytes": 2**24})
    expected = [(rid, {"echo": n}) for n, (rid, _) in reversed(list(enumerate(sent)))]
    assert [(r.request_id, r.body) for r in got[1:]] == expected
    assert client.handshake_done and client.in_flight == 0


def test_the_first_request_must_be_a_handshake() -> None:
    error = refusal(Connection(Role.SERVER), encode_frame(RequestCode.PING, 1, {}))
    assert error.code == ErrorCode.HANDSHAKE_REQUIRED


@pytest.mark.parametrize(
    ("server_token", "client_token", "code"),
    [
        ("secret", None, ErrorCode.UNAUTHORIZED),
        ("secret", "wrong", ErrorCode.UNAUTHORIZED),
        ("secret", "secret2", ErrorCode.UNAUTHORIZED),
        ("secret", "secret", None),
        (None, None, None),
        (None, "anything", None),  # a server without a token ignores one
    ],
)
def test_token(server_token: str | None, client_token: str | None, code: ErrorCode | None) -> None:
    client = Connection(Role.CLIENT, client_id="c", token=client_token)
    server = Connection(Role.SERVER, token=server_token)
    data = client.start_handshake()[1]
    if code is None:
        assert isinstance(events(server, data)[0], HandshakeAccepted)
    else:
        assert refusal(server, data).code == code


def test_a_token_that_is_not_a_string_is_unauthorized() -> None:
    body = {"version": PROTOCOL_VERSION, "client_id": "c", "token": 12345}
    assert refusal(Connection(Role.SERVER, token="12345"), handshake_frame(body)).code == ErrorCode.UNAUTHORIZED


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"version": 2, "client_id": "c"}, ErrorCode.UNSUPPORTED_VERSION),
        ({"version": 0, "client_id": "c"}, ErrorCode.UNSUPPORTED_VERSION),
        ({"version": "1", "client_id": "c"}, ErrorCode.BAD_BODY),
        ({"version": True, "client_id": "c"}, ErrorCode.BAD_BODY),
        ({"client_id": "c"}, ErrorCode.BAD_BODY),
        ({"version": 1}, ErrorCode.BAD_BODY),
        ({"version": 1, "client_id": ""}, ErrorCode.BAD_BODY),
        ({"version": 1, "client_id": "c" * 201}, ErrorCode.BAD_BODY),
        ({"version": 1, "client_id": 7}, ErrorCode.BAD_BODY),
        (None, ErrorCode.BAD_BODY),
    ],
)
def test_bad_handshakes(body: dict | None, code: ErrorCode) -> None:
    assert refusal(Connection(Role.SERVER), handshake_frame(body)).code == code


def test_a_second_handshake_or_a_reply_from_a_client_is_refused() -> None:
    client = Connection(Role.CLIENT, client_id="c")
    data = client.start_handshake()[1]
    server = Connection(Role.SERVER)
    events(server, data)
    assert refusal(server, handshake_frame({"version": 1, "client_id": "c"})).code == ErrorCode.BAD_REQUEST

    server = Connection(Role.SERVER)
    events(server, data)
    assert refusal(server, encode_frame(2, 5, {}, Flags.RESPONSE)).code == ErrorCode.BAD_FRAME


def test_oneway_requests_expect_no_reply() -> None:
    client = Connection(Role.CLIENT, client_id="c")
    server = Connection(Role.SERVER)
    data = client.start_handshake()[1]
    rid, oneway = client.send_request(RequestCode.PING, {"x": 1}, oneway=True)
    assert client.in_flight == 1  # the handshake only
    assert events(server, data + oneway)[1] == Request(rid, RequestCode.PING, {"x": 1}, oneway=True)
    assert refusal(client, server.send_response(rid, RequestCode.PING, {})).code == ErrorCode.BAD_FRAME


def test_a_reply_to_no_request_is_a_protocol_error() -> None:
    client = Connection(Role.CLIENT, client_id="c")
    client.start_handshake()
    server = Connection(Role.SERVER)
    assert refusal(client, server.send_response(99, RequestCode.PING, {})).code == ErrorCode.BAD_FRAME
    client = Connection(Role.CLIENT, client_id="c")
    client.start_handshake()
    assert refusal(client, encode_frame(RequestCode.PING, 1, {})).code == ErrorCode.BAD_FRAME  # not a reply


def test_an_abandoned_request_drops_its_late_reply() -> None:
    client = Connection(Role.CLIENT, client_id="c")
    server = Connection(Role.SERVER)
    client.start_handshake()
    late, _ = client.send_request(RequestCode.PING, {})
    other, _ = client.send_request(RequestCode.PING, {})
    client.abandon(late)
    data = server.send_response(late, 2, {}) + server.send_error(other, ErrorCode.BAD_REQUEST, "no")
    assert events(client, data) == [ErrorReply(other, ErrorCode.BAD_REQUEST, "no")]
    assert client.in_flight == 1  # the handshake


def test_error_frames() -> None:
    client = Connection(Role.CLIENT, client_id="c")
    server = Connection(Role.SERVER)
    rid, _ = client.start_handshake()
    long = server.send_error(rid, ErrorCode.UNAUTHORIZED, "x" * 5000)
    (reply,) = events(client, long)
    assert reply == ErrorReply(rid, ErrorCode.UNAUTHORIZED, "x" * MAX_ERROR_MESSAGE_LEN)
    assert not client.handshake_done and not reply.concerns_connection

    (whole,) = events(client, server.send_error(0, ErrorCode.UNAVAILABLE, "going away"))
    assert whole.concerns_connection and whole.code == ErrorCode.UNAVAILABLE

    for body in [{"code": "1", "message": "m"}, {"code": 1}, None]:
        client = Connection(Role.CLIENT, client_id="c")
        rid, _ = client.start_handshake()
        bad = encode_frame(0, rid, body, Flags.RESPONSE | Flags.ERROR)
        assert refusal(client, bad).code == ErrorCode.BAD_BODY


def test_request_ids_wrap_and_skip_those_in_flight() -> None:
    client = Connection(Role.CLIENT, client_id="c")
    hs, _ = client.start_handshake()
    assert hs == 1
    client._next_id = MAX_REQUEST_ID  # as if 2**32 - 2 requests had gone by
    ids = [client.send_request(2)[0] for _ in range(3)]
    assert ids == [MAX_REQUEST_ID, 2, 3]  # 0 is never used, 1 is still in flight


def test_a_request_over_the_limit_is_refused_locally_and_allocates_nothing() -> None:
    client = Connection(Role.CLIENT, client_id="c", limits=Limits(max_frame_bytes=100))
    client.start_handshake()
    with pytest.raises(ProtocolError) as info:
        client.send_request(2, {"b": b"x" * 200})
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE and not info.value.fatal
    assert client.in_flight == 1
    assert client.send_request(2, {})[0] == 2


def test_misuse_by_the_local_program_is_a_runtime_error() -> None:
    client = Connection(Role.CLIENT, client_id="c")
    with pytest.raises(RuntimeError):
        client.send_request(2)  # before the handshake
    with pytest.raises(RuntimeError):
        client.send_response(1, 2, {})
    client.start_handshake()
    with pytest.raises(RuntimeError):
        client.start_handshake()
    server = Connection(Role.SERVER)
    with pytest.raises(RuntimeError):
        server.send_request(2)
    assert encode_frame(2, 1) == encode_frame(2, 1, None, REQUEST)
