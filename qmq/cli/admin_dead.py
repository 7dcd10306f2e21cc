"""`qmq admin dead list|redrive|purge SUBJECT GROUP`: a consumer group's dead letters, on every
broker group of the subject. Re-drive and purge take all of them, or those named with --id."""

from __future__ import annotations

from typing import Any

import click

from qmq.admin.views import dead_view, per_group, totals
from qmq.cli.admin_options import admin_client, admin_options, confirm, emit, table
from qmq.cli.options import stacked
from qmq.client.admin import MAX_DEAD_SELECTED
from qmq.client.blocking import Admin

DEFAULT_LIST_MAX = 100


@click.group("dead")
def dead() -> None:
    """A consumer group's dead letters: list, re-drive, purge."""


@dead.command("list")
@click.argument("subject")
@click.argument("group")
@admin_options
@click.option("--max", "max_count", type=click.IntRange(1, 4096), default=DEFAULT_LIST_MAX, show_default=True)
def dead_list(subject, group, meta, brokers, delay_servers, token, as_json, log_level, max_count) -> None:
    """The dead letters of GROUP on SUBJECT not yet re-driven or purged (per broker group, up to
    --max each): id, key, attempts, the last failure's reason, the body decoded."""
    with admin_client(meta, brokers, delay_servers, token, log_level) as admin:
        view = dead_view(admin.dead_list(subject, group, max_count))
    emit(view, as_json, _render_list)


def _render_list(view: dict[str, Any]) -> None:
    table(
        view["messages"],
        ["broker_group", "seq", "id", "key", "attempts", "dead_at", "reason", "body"],
        empty="(no dead letters)",
    )


def _selection(admin: Admin, subject: str, group: str, ids: tuple[str, ...]) -> dict[str, list[int]] | None:
    """The dead letters named by `ids`, as sequences by broker group (None: all of them)."""
    if not ids:
        return None
    listed = dead_view(admin.dead_list(subject, group, MAX_DEAD_SELECTED))["messages"]
    chosen: dict[str, list[int]] = {}
    found = set()
    for m in listed:
        if m["id"] in ids:
            chosen.setdefault(m["broker_group"], []).append(m["seq"])
            found.add(m["id"])
    missing = [i for i in ids if i not in found]
    if missing:
        raise click.ClickException(f"no dead letter of group {group} on {subject} has id {', '.join(missing)}")
    return chosen


def _dead_action(name: str, field: str, subject, group, ids, yes, options) -> None:
    meta, brokers, delay_servers, token, as_json, log_level = options
    with admin_client(meta, brokers, delay_servers, token, log_level) as admin:
        selection = _selection(admin, subject, group, ids)
        what = f"the {len(ids)} dead letters named" if ids else "every dead letter"
        confirm(f"{name.capitalize()} {what} of group {group} on {subject}?", yes)
        answers = (admin.redrive if name == "re-drive" else admin.purge)(subject, group, selection)
    data = {field: totals(answers, field), "broker_groups": per_group(answers), "errors": []}
    data["errors"] = [{"group": a.group, "address": a.address, "error": a.error} for a in answers if not a.ok]
    emit(data, as_json, lambda d: click.echo(f"{d[field]} dead letters {field} ({subject}, group {group})"))


dead_selection = stacked(
    click.argument("subject"),
    click.argument("group"),
    admin_options,
    click.option("--id", "ids", multiple=True, help="only this dead letter (repeat for several) [default: all]"),
    click.option("-y", "--yes", is_flag=True, help="do not ask for confirmation"),
)


@dead.command("redrive")
@dead_selection
def dead_redrive(subject, group, meta, brokers, delay_servers, token, as_json, log_level, ids, yes) -> None:
    """Send GROUP's dead letters on SUBJECT back to the group (through its retry subject, attempt 1
    again): all of them, or those named with --id."""
    _dead_action(
        "re-drive", "redriven", subject, group, ids, yes, (meta, brokers, delay_servers, token, as_json, log_level)
    )


@dead.command("purge")
@dead_selection
def dead_purge(subject, group, meta, brokers, delay_servers, token, as_json, log_level, ids, yes) -> None:
    """Drop GROUP's dead letters on SUBJECT (all, or those named with --id): no longer listed,
    counted or re-driven (they stay in the log until its retention)."""
    _dead_action("purge", "purged", subject, group, ids, yes, (meta, brokers, delay_servers, token, as_json, log_level))
