"""`qmq send`: send messages from the command line, printing each id once a broker (or, for a
delayed message, a delay server) stored it."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import click

from qmq.cli.client_options import client_options, make_client
from qmq.cli.options import delay_servers_option, tuning
from qmq.client import ClientError, OutgoingMessage, SendResult
from qmq.client.routes import no_route_error
from qmq.client.sending import DEFAULT_BATCH_SIZE, DELIVERY_TIMEOUT_S
from qmq.protocol.envelope import JSON
from qmq.protocol.errors import ProtocolError
from qmq.protocol.limits import validate_subject

CHUNK_BATCHES = 16  # one send() call covers this many batches; ids are printed after each call
MAX_FAILURES_SHOWN = 10  # failed messages named one by one; the rest are counted
MAX_BATCH = 4096  # messages per send request, at most
AT_HELP = "deliver at this time, with its zone (2026-12-24T18:00:00+01:00, or Z for UTC)"
SIZE_HELP = "send BYTES random bytes as each body, instead of BODY"
DELAY_HELP = "deliver after this many seconds (through a delay server)"


@click.command("send")
@click.argument("subject")
@click.argument("body", required=False)
@client_options
@click.option("--tag", "tags", multiple=True, help="a tag consumers can filter on (repeat for several)")
@click.option("--key", default=None, help="the message key (indexed by the broker for look-ups)")
@click.option(
    "--order-key",
    default=None,
    metavar="K",
    help="order per key: the messages of one key are handled in the order sent (docs/ordering.md)",
)
@click.option("--header", "headers", multiple=True, metavar="K=V", help="a header (repeat for several)")
@click.option("--json", "as_json", is_flag=True, help="BODY is JSON: send it as application/json")
@click.option("--delay", type=click.FloatRange(min=0), metavar="SECONDS", help=DELAY_HELP)
@click.option(
    "--at", metavar="ISO8601", help="deliver at this time, with its zone (2026-12-24T18:00:00+01:00, or Z for UTC)"
)
@delay_servers_option("a delay server to use directly, instead of the meta server's (repeat for several)")
@tuning("--count", click.IntRange(min=1), 1, "messages to send")
@click.option(
    "--size", type=click.IntRange(min=0), metavar="BYTES", help="send BYTES random bytes as each body, not BODY"
)
@tuning("--batch", click.IntRange(1, MAX_BATCH), DEFAULT_BATCH_SIZE, "messages per broker request")
@tuning(
    "--delivery-timeout",
    click.FloatRange(min=0),
    DELIVERY_TIMEOUT_S,
    "seconds a message that could not be stored (a broker down, a failover) is offered again before it fails",
    dest="delivery_timeout",
)
def send(
    subject: str,
    body: str | None,
    meta: str | None,
    brokers: tuple[str, ...],
    token: str | None,
    log_level: str,
    tags: tuple[str, ...],
    key: str | None,
    order_key: str | None,
    headers: tuple[str, ...],
    as_json: bool,
    delay: float | None,
    at: str | None,
    delay_servers: tuple[str, ...],
    count: int,
    size: int | None,
    batch: int,
    delivery_timeout: float,
) -> None:
    """Send COUNT messages to SUBJECT and print each message id, one per line, once a broker has
    stored it (with --delay or --at: once a delay server has). The body is BODY (text), --size
    random bytes, or else all of standard input."""
    deliver_at = _deliver_at(delay, at)
    if order_key is not None and deliver_at is not None:
        raise click.UsageError(
            "--order-key cannot be combined with --delay or --at: a delayed message leaves its order"
        )
    make_body = _body_maker(body, size, as_json)
    header_map = _parse_headers(headers)
    client = make_client(
        meta,
        brokers,
        token,
        log_level,
        batch_size=batch,
        delivery_timeout_s=delivery_timeout,
        delay_servers=list(delay_servers),
    )
    try:
        _check_route(client, subject, delayed=deliver_at is not None, wait_s=delivery_timeout)
        sent = 0
        while sent < count:
            n = min(count - sent, batch * CHUNK_BATCHES)
            messages = [
                OutgoingMessage(
                    subject,
                    make_body(),
                    key=key,
                    tags=tags,
                    headers=header_map,
                    deliver_at=deliver_at,
                    content_type=JSON if as_json else None,
                    order_key=order_key,
                )
                for _ in range(n)
            ]
            results = client.send(messages)
            for result in results:
                if result.ok:
                    click.echo(result.message_id)
            sys.stdout.flush()
            failed = [r for r in results if not r.ok]
            if failed:
                _report(failed, count - sent - n)
            sent += n
    finally:
        client.close()


def _deliver_at(delay: float | None, at: str | None) -> int | None:
    """ms since the epoch from --delay or --at; None for neither."""
    if delay is not None and at is not None:
        raise click.UsageError("give --delay or --at, not both")
    if delay is not None:
        return time.time_ns() // 1_000_000 + round(delay * 1000)
    if at is None:
        return None
    try:
        when = datetime.fromisoformat(at)
    except ValueError:
        raise click.UsageError(f"--at {at!r} is not an ISO 8601 time (2026-12-24T18:00:00+01:00)") from None
    if when.tzinfo is None:
        raise click.UsageError(f"--at {at!r} has no time zone: add one (+01:00, or Z for UTC)")
    return int(when.timestamp() * 1000)


def _body_maker(body: str | None, size: int | None, as_json: bool) -> Callable[[], Any]:
    """What each message's body is made by: the same BODY, fresh random bytes, or standard input."""
    if body is not None and size is not None:
        raise click.UsageError("give BODY or --size, not both")
    if size is not None:
        if as_json:
            raise click.UsageError("--json needs BODY, not --size")
        return lambda: os.urandom(size)
    if body is None:
        raw = click.get_binary_stream("stdin").read()
        try:
            body = raw.decode()
        except UnicodeDecodeError:
            if as_json:
                raise click.UsageError("--json: standard input is not UTF-8 text") from None
            return lambda: raw
    value: Any = body
    if as_json:  # checked, then sent as written: application/json whatever the value (a string too)
        try:
            json.loads(body, parse_constant=_no_constant)
        except ValueError as exc:
            raise click.UsageError(f"--json: BODY is not JSON: {exc}") from None
        value = body.encode()
    return lambda: value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (JSON has no NaN or Infinity)")


def _parse_headers(headers: tuple[str, ...]) -> dict[str, str] | None:
    out = {}
    for item in headers:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise click.UsageError(f"--header {item!r} must be NAME=VALUE")
        out[name] = value
    return out or None


def _check_route(client: Any, subject: str, *, delayed: bool = False, wait_s: float = 0.0) -> None:
    """Name the problem once, before sending, when the subject is not allowed, the meta server is
    unreachable, or it knows no broker group (or delay server) that takes the subject: an error, or
    with `wait_s` (--delivery-timeout) a warning, and the send waits that long for one."""
    try:
        validate_subject(subject)
    except ProtocolError as exc:
        raise click.UsageError(exc.message) from None
    if delayed and client.delay_servers:
        return  # given directly: the meta server is not asked (nor needed)
    problem = _route_problem(client, subject, delayed)
    if problem is None:
        return
    if not wait_s or client.meta is None:  # brokers given directly: no group can appear
        raise click.ClickException(problem)
    click.echo(f"qmq send: {problem}; waiting up to {wait_s:g} s for one (--delivery-timeout)", err=True)


def _route_problem(client: Any, subject: str, delayed: bool) -> str | None:
    """Why no message of `subject` can be sent now; None when one can."""
    try:
        route = client.route(subject)
    except ClientError as exc:
        return str(exc)
    if delayed:
        if route.delay_route.writable_groups:
            return None
        return (
            "no delay server is available for delayed messages: start `qmq delay-server` "
            "with --meta, or give --delay-server HOST:PORT"
        )
    if route.writable_groups:
        return None
    if route.groups:
        names = ", ".join(g.name for g in route.groups)
        return f"no broker group takes messages for {subject!r} now: its groups ({names}) are unavailable or read-only"
    return str(no_route_error(client.meta, subject))


def _report(failed: list[SendResult], not_tried: int) -> None:
    for result in failed[:MAX_FAILURES_SHOWN]:
        click.echo(f"qmq send: message {result.message_id} was not sent: {result.error}", err=True)
    if len(failed) > MAX_FAILURES_SHOWN:
        click.echo(f"qmq send: ... and {len(failed) - MAX_FAILURES_SHOWN} more not sent", err=True)
    more = f"; {not_tried} more were not tried" if not_tried else ""
    raise click.ClickException(f"{len(failed)} message(s) were not sent{more}")
