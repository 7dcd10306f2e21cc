"""`qmq admin lookup --id ID | --key SUBJECT KEY [--db URL]`: a message and its life, from every
broker group (copies, pulls, acks, retries, dead letters, re-drives), the delay servers, and given
--db the application's database (its outbox row, the groups that consumed it)."""

from __future__ import annotations

import json
from typing import Any

import click

from qmq.admin.views import lookup_view
from qmq.cli.admin_options import admin_client, admin_options, emit, table
from qmq.db.url import DB_URL_ENV


@click.command("lookup")
@admin_options
@click.option("--id", "message_id", default=None, help="the message id")
@click.option("--key", "subject_key", nargs=2, default=None, metavar="SUBJECT KEY", help="a subject and message key")
@click.option(
    "--db", "db_url", envvar=DB_URL_ENV, default=None, metavar="URL", help="the app's database [env QMQ_DB_URL]"
)
def lookup(meta, brokers, delay_servers, token, as_json, log_level, message_id, subject_key, db_url) -> None:
    """Find a message by --id, or by --key SUBJECT KEY, and tell its life: where and when it was
    stored, which consumer of which group pulled it, acked, retried, dead-lettered, re-driven, and
    what became of it in each consumer group. Exit status 1 when no server holds it."""
    if (message_id is None) == (subject_key is None):
        raise click.UsageError("give --id ID or --key SUBJECT KEY")
    subject, key = subject_key or (None, None)
    with admin_client(meta, brokers, delay_servers, token, log_level) as admin:
        view = lookup_view(*admin.lookup(message_id, subject, key))
    if db_url:
        ids = [message_id] if message_id else list(dict.fromkeys(m["id"] for m in view["messages"]))
        from qmq.admin.database import message_rows  # SQLAlchemy: only for --db

        view["database"] = {i: message_rows(db_url, i) for i in ids}
    found = view["messages"] or view["delayed"] or any(d["outbox"] for d in view.get("database", {}).values())
    emit(view, as_json, _render)
    if not found:
        raise SystemExit(1)


def _render(view: dict[str, Any]) -> None:
    if not (view["messages"] or view["delayed"]):
        click.echo("not found on any broker or delay server")
    for m in view["messages"]:
        click.echo(
            f"message {m['id']}  subject {m['subject']}  key {m['key'] or '-'}  tags {','.join(m['tags']) or '-'}"
        )
        click.echo(f"  stored on broker group {m['broker_group']} ({m['broker']}) at {m['stored_at']}, seq {m['seq']}")
        body = m["body"] if isinstance(m["body"], str) else json.dumps(m["body"], ensure_ascii=False)
        click.echo(f"  body ({m['content_type']}): {body}")
        click.echo("  life:")
        table(
            m["life"],
            ["at", "event", "group", "consumer", "attempt", "reason", "retry_at"],
        )
        if m["truncated"]:
            click.echo("  (the journal is longer than a look-up reads: later events are not shown)")
        table(
            m["summary"],
            ["group", ("now", "fate"), "since", "deliveries", "failures", ("last failure", "last_reason")],
        )
        click.echo("  now, per consumer group: " + (", ".join(f"{g} {s}" for g, s in m["groups"].items()) or "-"))
    for d in view["delayed"]:
        click.echo(f"delayed message {d['id']} on {d['delay_server']}: {d['state']}, due {d['deliver_at']}")
    for message_id, rows in view.get("database", {}).items():
        outbox = rows["outbox"]
        if outbox:
            click.echo(
                f"outbox row of {message_id}: {outbox['state']}, created {outbox['created_at']}, sent "
                f"{outbox['sent_at'] or '-'}, attempts {outbox['attempts']}"
                + (f", last error {outbox['last_error']}" if outbox["last_error"] else "")
            )
        else:
            click.echo(f"no outbox row for {message_id}")
        for row in rows["consumed"]:
            click.echo(f"  consumed by group {row['consumer_group']} at {row['consumed_at']}")
        for error in rows["errors"]:
            click.echo(f"  ({error})")
