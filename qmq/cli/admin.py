"""`qmq admin`: operate a running cluster from a shell (docs/operating.md). Each sub-command lives
in a module beside this one (`admin_stats`, `admin_dead`, `admin_groups`, `admin_lookup`,
`admin_failover`, `admin_members`); they all use the client's administration calls
(`qmq.client.admin`, `qmq.admin.members`), as the web console does."""

from __future__ import annotations

import click

from qmq.cli.admin_credentials import credentials
from qmq.cli.admin_dead import dead
from qmq.cli.admin_failover import failover
from qmq.cli.admin_groups import group, reset
from qmq.cli.admin_lookup import lookup
from qmq.cli.admin_members import group_forget, group_show
from qmq.cli.admin_stats import inspect, stats


@click.group("admin")
def admin() -> None:
    """Operate a running cluster: figures, dead letters, positions, look-ups, workers."""


for command in (stats, dead, reset, group, lookup, inspect, failover, credentials):
    admin.add_command(command)
group.add_command(group_show)
group.add_command(group_forget)
