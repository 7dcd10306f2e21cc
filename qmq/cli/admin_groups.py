"""`qmq admin reset SUBJECT GROUP --to ...` and `qmq admin group create|delete SUBJECT GROUP`:
a consumer group's position, on every broker group of the subject."""

from __future__ import annotations

from typing import Any

import click

from qmq.admin.positions import POSITION_FORMS, parse_position
from qmq.admin.views import errors, per_group
from qmq.cli.admin_options import admin_client, admin_options, confirm, emit, table

POSITION_HELP = POSITION_FORMS


def position(text: str) -> tuple[str | int, int | None]:
    try:
        return parse_position(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _render(data: dict[str, Any]) -> None:
    table(data["broker_groups"], [("broker group", "group"), "address", *data["columns"]])


@click.command("reset")
@click.argument("subject")
@click.argument("group")
@admin_options
@click.option("--to", "to", required=True, metavar="POSITION", help=POSITION_HELP)
@click.option("-y", "--yes", is_flag=True, help="do not ask for confirmation")
def reset(subject, group, meta, brokers, delay_servers, token, as_json, log_level, to, yes) -> None:
    """Move GROUP's position on SUBJECT (every broker group): back to replay, forward to skip. A group
    that does not exist yet is made at that position."""
    position_, time_ms = position(to)
    with admin_client(meta, brokers, delay_servers, token, log_level) as admin:
        confirm(f"Move group {group} on {subject} to {to}?", yes)
        answers = admin.reset(subject, group, position_, time_ms)
    data = {"broker_groups": per_group(answers), "errors": errors(answers), "columns": ["cursor"]}
    emit({k: v for k, v in data.items() if k != "columns"} if as_json else data, as_json, _render)


@click.group("group")
def group() -> None:
    """Consumer groups: create one before its consumers run, delete one no longer used; and the
    members of a replicated broker group (show, forget)."""


@group.command("create")
@click.argument("subject")
@click.argument("group_name", metavar="GROUP")
@admin_options
@click.option("--from", "start", default="latest", show_default=True, metavar="POSITION", help=POSITION_HELP)
def group_create(subject, group_name, meta, brokers, delay_servers, token, as_json, log_level, start) -> None:
    """Make GROUP on SUBJECT on every broker group, starting at --from (an existing group is left
    where it is)."""
    position_, time_ms = position(start)
    with admin_client(meta, brokers, delay_servers, token, log_level) as admin:
        answers = admin.group_create(subject, group_name, position_, time_ms)
    data = {
        "broker_groups": per_group(answers),
        "errors": errors(answers),
        "columns": ["created", "cursor"],
    }
    emit({k: v for k, v in data.items() if k != "columns"} if as_json else data, as_json, _render)


@group.command("delete")
@click.argument("subject")
@click.argument("group_name", metavar="GROUP")
@admin_options
@click.option("--force", is_flag=True, help="even while consumers of the group are alive")
@click.option("-y", "--yes", is_flag=True, help="do not ask for confirmation")
def group_delete(subject, group_name, meta, brokers, delay_servers, token, as_json, log_level, force, yes) -> None:
    """Delete GROUP on SUBJECT everywhere: its position, pending retries and dead letters. Refused
    while its consumers are alive, unless --force."""
    with admin_client(meta, brokers, delay_servers, token, log_level) as admin:
        confirm(f"Delete group {group_name} on {subject}, with its retries and dead letters?", yes)
        answers = admin.group_delete(subject, group_name, force)
    data = {"broker_groups": per_group(answers), "errors": errors(answers), "columns": ["deleted"]}
    emit({k: v for k, v in data.items() if k != "columns"} if as_json else data, as_json, _render)
