"""`qmq admin failover --group G [--to ADDR]`: switch a replicated group's master by hand (a broker
group, or a delay-server group named `delay:NAME`), for
maintenance (docs/replication.md): the master stops taking sends, a replica catches up with its whole
log, the meta server makes it master with the next epoch, and the command returns once it serves."""

from __future__ import annotations

import click

from qmq.cli.admin_options import admin_client, admin_options, emit
from qmq.cli.options import POSITIVE_SECONDS
from qmq.client.admin import FAILOVER_TIMEOUT_S


@click.command("failover")
@admin_options
@click.option("--group", "group_name", required=True, help="the replicated group (delay:NAME for a delay-server group)")
@click.option("--to", default=None, metavar="HOST:PORT", help="the replica to promote [default: the in-sync one]")
@click.option(
    "--timeout",
    type=POSITIVE_SECONDS,
    default=FAILOVER_TIMEOUT_S,
    show_default=True,
    help="seconds to wait for a replica to catch up",
)
def failover(meta, brokers, delay_servers, token, as_json, log_level, group_name, to, timeout) -> None:
    """Make a replica of GROUP its master, without losing an acknowledged message."""
    with admin_client(meta, brokers, delay_servers, token, log_level) as admin:
        done = admin.failover(group_name, to, timeout)
    emit(
        done,
        as_json,
        lambda d: click.echo(
            f"group {d['group']}: {d['master']} is master, epoch {d['epoch']} (was {d['old_master']}, "
            f"log end {d['end']})"
        ),
    )
