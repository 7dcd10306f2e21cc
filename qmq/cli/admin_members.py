"""`qmq admin group show --group G` and `qmq admin group forget --group G --broker ADDR`: the members
of a replicated broker group or delay-server group (`--group delay:NAME`): roles, epoch, offsets,
lag; and the removal of one gone for good (docs/replication.md). Both ask the meta server, so they
take --meta but not the servers-directly options; here `--broker` names the member (a delay server
too)."""

from __future__ import annotations

from typing import Any

import click

from qmq.admin import members
from qmq.cli.admin_options import admin_client, emit, table
from qmq.cli.net_options import tls_client_options
from qmq.cli.options import log_level_option, meta_option, stacked, token_option
from qmq.client.blocking import blocking
from qmq.protocol.limits import DELAY_GROUP_PREFIX

member_options = stacked(
    tls_client_options,
    meta_option(),
    token_option(),
    click.option("--json", "as_json", is_flag=True, help="print one JSON document (for scripts)"),
    log_level_option(help="logged to stderr"),
    click.option(
        "--group",
        "group_name",
        required=True,
        help="the replicated group: `qmq broker --group` G, or delay:NAME for `qmq delay-server --group NAME`",
    ),
)

_show = blocking(members.show)
_forget = blocking(members.forget)


def _render_show(data: dict[str, Any]) -> None:
    kind = "delay-server group" if data["group"].startswith(DELAY_GROUP_PREFIX) else "broker group"
    click.echo(f"{kind} {data['group']}: master {data['master']}, epoch {data['epoch']}")
    click.echo(f"ack rule: {data['ack_rule']['text']}")
    table(
        data["members"],
        ["address", "role", "says", "epoch", "log_end", "durable", "in_sync", "lag_bytes", "lag_s", "reported_s_ago"],
    )


def _render_forget(data: dict[str, Any]) -> None:
    left = ", ".join(data["replicas"]) or "none"
    click.echo(f"group {data['group']}: forgot {data['forgotten']} (silent {data['silent_s']:.1f} s)")
    click.echo(f"members: master {data['master']} (epoch {data['epoch']}), replicas: {left}")
    if not data["master_dropped"]:
        click.echo("the master still counts it (it fetched lately, or the master did not answer)")
    click.echo(f"ack rule now: {data['ack_rule']['text']}")


@click.command("show")
@member_options
def group_show(meta, token, as_json, log_level, group_name) -> None:
    """The members of a replicated GROUP: role, epoch, log end, durable offset, whether in
    sync and the lag, and what a send needs now."""
    with admin_client(meta, (), (), token, log_level) as admin:
        data = _show(admin, group_name)
    emit(data, as_json, _render_show)


@click.command("forget")
@member_options
@click.option("--broker", "address", required=True, metavar="HOST:PORT", help="the member gone for good")
@click.option("--force", is_flag=True, help="even if it reported within --failover-after (it looks alive)")
def group_forget(meta, token, as_json, log_level, group_name, address, force) -> None:
    """Remove a member gone for good (machine lost) from a replicated GROUP, so it no longer
    counts as a replica out of sync. Refused for the master, and for a member that reported lately
    unless --force."""
    with admin_client(meta, (), (), token, log_level) as admin:
        data = _forget(admin, group_name, address, force)
    emit(data, as_json, _render_forget)
