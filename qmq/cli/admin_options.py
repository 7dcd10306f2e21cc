"""What every `qmq admin` sub-command shares: where the servers are (--meta, --broker,
--delay-server), the token, --json, the `Admin` client made from them, and the output: one JSON
document with --json, readable tables otherwise; a server that did not answer is said on stderr and
makes the exit status 1, after what the others answered is printed."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click

from qmq.cli.net_options import tls_client_options
from qmq.cli.options import (
    brokers_option,
    choose_meta,
    delay_servers_option,
    log_level_option,
    meta_option,
    setup_logging,
    stacked,
    token_option,
)
from qmq.client import ClientError
from qmq.client.blocking import Admin

MAX_CELL = 60  # characters of a table cell; --json has everything


admin_options = stacked(
    tls_client_options,
    meta_option(),
    brokers_option("a broker to ask directly, without a meta server (repeat for several)"),
    delay_servers_option("a delay server to ask directly (repeat for several)"),
    token_option(),
    click.option("--json", "as_json", is_flag=True, help="print one JSON document (for scripts)"),
    log_level_option(help="logged to stderr"),
)
"""--meta, --broker, --delay-server, --token, --json and --log-level, in that order in --help."""


@contextmanager
def admin_client(
    meta: str | None, brokers: Sequence[str], delay_servers: Sequence[str], token: str | None, log_level: str
) -> Iterator[Admin]:
    """The `Admin` client for a command; bad addresses are usage errors, client errors clean ones."""
    setup_logging(log_level)
    meta = choose_meta(meta, brokers)
    try:
        admin = Admin(
            meta=meta,
            brokers=list(brokers) or None,
            delay_servers=list(delay_servers) or None,
            token=token or None,
            client_id="qmq-admin",
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        yield admin
    except ClientError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        admin.close()


def report(
    options: dict[str, Any], fetch: Callable[[Admin], dict[str, Any]], render: Callable[[dict[str, Any]], None]
) -> None:
    """A read-only command: `fetch` a view with the client `options` (admin_options' values) make,
    then `emit` it."""
    as_json = options.pop("as_json")
    with admin_client(**options) as admin:
        view = fetch(admin)
    emit(view, as_json, render)


def emit(data: dict[str, Any], as_json: bool, render: Callable[[dict[str, Any]], None]) -> None:
    """Print `data` (JSON, or `render`ed), then the servers that did not answer on stderr; exit 1
    if there were any."""
    if as_json:
        click.echo(json.dumps(data, indent=2, ensure_ascii=False, default=str))
    else:
        render(data)
    failed = data.get("errors") or []
    for item in failed:
        click.echo(f"qmq admin: {item['group']} ({item['address']}) did not answer: {item['error']}", err=True)
    if failed:
        sys.exit(1)


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, list | tuple):
        value = ",".join(str(v) for v in value)
    elif isinstance(value, dict):
        value = json.dumps(value, ensure_ascii=False, default=str)
    text = str(value).replace("\n", " ")
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str | tuple[str, str]], empty: str = "(none)") -> None:
    """Rows as aligned columns: `columns` are keys (headed by the key with spaces for underscores)
    or (heading, key) pairs."""
    if not rows:
        click.echo(empty)
        return
    columns = [(c.replace("_", " "), c) if isinstance(c, str) else c for c in columns]
    cells = [[cell(row.get(key)) for _heading, key in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, (h, _k) in enumerate(columns)]
    click.echo("  ".join(h.upper().ljust(w) for (h, _k), w in zip(columns, widths, strict=True)).rstrip())
    for r in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def confirm(question: str, yes: bool) -> None:
    """Ask before an action (--yes answers for a script); no terminal and no --yes is a refusal."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise click.UsageError(f"{question} Give --yes to do it without a terminal to ask on.")
    click.confirm(question, abort=True)
