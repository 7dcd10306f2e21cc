"""What every `qmq admin` sub-command shares: where the servers are (--meta, --broker,
--delay-server), the token, --json, the `Admin` client made from them, and the output: one JSON
document with --json, readable tables otherwise; a server that did not answer is said on stderr and
makes the exit status 1, after what the others answered is printed."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import click

from qmq.cli.net_options import tls_client_options
from qmq.client import ClientError
from qmq.client.blocking import Admin
from qmq.client.routes import DEFAULT_META_ADDRESS, META_ENV
from qmq.net.common import TOKEN_ENV

F = TypeVar("F", bound=Callable[..., Any])
MAX_CELL = 60  # characters of a table cell; --json has everything


def admin_options(fn: F) -> F:
    """--meta, --broker, --delay-server, --token, --json and --log-level, in that order in --help."""
    for option in reversed(
        [
            click.option(
                "--meta",
                envvar=META_ENV,
                default=None,
                metavar="HOST:PORT",
                help=f"meta server [env {META_ENV}; default {DEFAULT_META_ADDRESS}]",
            ),
            click.option(
                "--broker",
                "brokers",
                multiple=True,
                metavar="HOST:PORT",
                help="a broker to ask directly, without a meta server (repeat for several)",
            ),
            click.option(
                "--delay-server",
                "delay_servers",
                multiple=True,
                metavar="HOST:PORT",
                help="a delay server to ask directly (repeat for several)",
            ),
            click.option("--token", envvar=TOKEN_ENV, default=None, help=f"token the servers expect [env {TOKEN_ENV}]"),
            click.option("--json", "as_json", is_flag=True, help="print one JSON document (for scripts)"),
            click.option("-l", "--log-level", default="WARNING", show_default=True, help="logged to stderr"),
        ]
    ):
        fn = option(fn)
    return tls_client_options(fn)


@contextmanager
def admin_client(
    meta: str | None, brokers: Sequence[str], delay_servers: Sequence[str], token: str | None, log_level: str
) -> Iterator[Admin]:
    """The `Admin` client for a command; bad addresses are usage errors, client errors clean ones."""
    logging.basicConfig(level=log_level.upper(), format="qmq %(levelname)s %(name)s: %(message)s")
    if meta and brokers:
        source = click.get_current_context().get_parameter_source("meta")
        if source is not click.core.ParameterSource.ENVIRONMENT:
            raise click.UsageError("give --meta or --broker, not both")
        meta = None  # --broker wins over a meta server that came from the environment
    try:
        admin = Admin(
            meta=meta or None,
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


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]], empty: str = "(none)") -> None:
    """Rows as aligned columns: `columns` are (heading, key)."""
    if not rows:
        click.echo(empty)
        return
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
