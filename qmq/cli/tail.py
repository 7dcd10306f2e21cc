"""`qmq tail`: consume a subject as a consumer group and print each message as one JSON line.

Each message is printed and stdout flushed before it is acknowledged, so a message is never
acknowledged without having been written out. Acknowledgements are flushed on exit, Ctrl-C included.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import threading
import time
from datetime import datetime
from typing import Any

import click

from qmq.cli.client_options import client_options, make_client
from qmq.client import ClientError, Delivery
from qmq.client.deliveries import DEFAULT_PULL_MAX

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_CHECK_S = 0.25  # a stop request is seen within this long (plus the batch being printed); the
# cost: an idle tail asks each broker about four times a second


@click.command("tail")
@click.argument("subject")
@click.option("--group", required=True, help="consumer group name: members share the messages")
@client_options
@click.option(
    "--from",
    "start",
    type=click.Choice(["earliest", "latest"]),
    default="latest",
    show_default=True,
    help="where a group new to a broker starts",
)
@click.option("--count", type=click.IntRange(min=1), default=None, help="exit after this many messages")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="exit after this long without a message [default: run until Ctrl-C]",
)
@click.option("--tag", "tags", multiple=True, help="only messages with this tag (repeat: any of them)")
@click.option("--match-all", is_flag=True, help="with several --tag: only messages with all of them")
@click.option("--broadcast", is_flag=True, help="get every message, with a position of this consumer's own")
@click.option("--consumer", default=None, help="consumer id [default: hostname-pid-random]")
def tail(
    subject: str,
    group: str,
    meta: str | None,
    brokers: tuple[str, ...],
    token: str | None,
    log_level: str,
    start: str,
    count: int | None,
    timeout: float | None,
    tags: tuple[str, ...],
    match_all: bool,
    broadcast: bool,
    consumer: str | None,
) -> None:
    """Print the messages of SUBJECT, one JSON object per line, acknowledging each once printed.

    Fields: id, subject, body (a JSON value, text, or base64 with "body_encoding": "base64"),
    content_type, tags, key, headers, attempts, created_at, stored_at (ISO 8601). A line on stderr
    says when the group is registered with every broker and waiting."""
    client = make_client(meta, brokers, token, log_level)
    try:
        try:
            subscription = client.subscribe(
                subject, group, consumer=consumer, tags=tags, match_all=match_all, broadcast=broadcast, start=start
            )
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        except ClientError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(
            f"qmq tail: waiting for messages on {subject} as group {group} (consumer {subscription.consumer})", err=True
        )
        # Ctrl-C and a stop request end the loop between pulls (never an exception in the middle of the
        # client's work, which could leave a lock taken); what was printed is acknowledged on the way out.
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in STOP_SIGNALS}
        try:
            _run(subscription, count, timeout, stop)
        except BrokenPipeError:  # the reader went away (| head): stop quietly, like other Unix tools
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except ClientError as exc:
            raise click.ClickException(str(exc)) from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            subscription.close()
    finally:
        client.close()


def _run(subscription: Any, count: int | None, timeout: float | None, stop: threading.Event) -> None:
    out = sys.stdout
    received = 0
    last_message_at = time.monotonic()
    while (count is None or received < count) and not stop.is_set():
        wait_s = STOP_CHECK_S  # each long poll is this short, so a stop is seen soon
        if timeout is not None:
            left = last_message_at + timeout - time.monotonic()
            if left <= 0:
                return
            wait_s = min(wait_s, left)
        limit = DEFAULT_PULL_MAX if count is None else min(DEFAULT_PULL_MAX, count - received)
        for delivery in subscription.pull(max=limit, wait_s=wait_s):
            out.write(json.dumps(delivery_json(delivery), ensure_ascii=False) + "\n")
            out.flush()
            subscription.ack(delivery)
            received += 1
            last_message_at = time.monotonic()


def delivery_json(delivery: Delivery) -> dict[str, Any]:
    """A delivery as `qmq tail` prints it."""
    item: dict[str, Any] = {"id": delivery.id, "subject": delivery.subject}
    if isinstance(delivery.body, bytes):  # JSON and text bodies arrive decoded, anything else as bytes
        item["body"] = base64.b64encode(delivery.body).decode()
        item["body_encoding"] = "base64"
    else:
        item["body"] = delivery.body
    item.update(
        {
            "content_type": delivery.content_type,
            "tags": list(delivery.tags),
            "key": delivery.key,
            "headers": delivery.headers,
            "attempts": delivery.attempt,
            "created_at": _iso(delivery.created_at),
            "stored_at": _iso(delivery.stored_at),
        }
    )
    return item


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z") if moment else None
