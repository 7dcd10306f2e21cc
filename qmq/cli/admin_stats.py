"""`qmq admin stats` (broker groups, subjects and consumer groups with their figures and rates) and
`qmq admin inspect` (running workers: their consumers, concurrency, messages in flight)."""

from __future__ import annotations

from typing import Any

import click

from qmq.admin.views import stats_view, workers_view
from qmq.cli.admin_options import admin_options, report, table


@click.command("stats")
@admin_options
def stats(**options: Any) -> None:
    """Per broker server: role, replicas and lag (when replicated), read-only; per subject: stored and
    the rate in; per subject and consumer group: backlog, in flight, retrying, dead, consumers and
    the rate out (messages per second over the last minute)."""
    report(options, lambda admin: stats_view(admin.stats()), _render_stats)


def _render_stats(view: dict[str, Any]) -> None:
    click.echo("Broker servers")
    table(
        view["brokers"],
        ["group", "address", "role", "replicas", "lag", ("read-only", "read_only"), "subjects"],
    )
    click.echo("\nSubjects")
    table(
        view["subjects"],
        ["subject", "stored", ("in/s", "in_rate"), ("consumer groups", "groups")],
    )
    click.echo("\nConsumer groups")
    table(
        view["groups"],
        ["subject", "group", "backlog", "in_flight", "retrying", "dead", "consumers", "acked", ("out/s", "out_rate")],
    )


@click.command("inspect")
@admin_options
def inspect(**options: Any) -> None:
    """Running workers (as `celery inspect active`): from the heartbeats the brokers receive, each
    worker's host, pid, pool and concurrency, its consumers and the messages it is running; then
    every consumer the brokers know, with the messages it holds."""
    report(options, lambda admin: workers_view(admin.consumers()), _render_workers)


def _render_workers(view: dict[str, Any]) -> None:
    click.echo("Workers")
    table(
        view["workers"],
        ["consumer", "app", "host", "pid", "pool", "concurrency", "in_flight", "reported_s_ago"],
        empty="(no worker reported in its heartbeats)",
    )
    running = [{"consumer": w["consumer"], **r} for w in view["workers"] for r in w["running"] if isinstance(r, dict)]
    if running:
        click.echo("\nRunning")
        table(
            running,
            ["consumer", "subject", "group", "id", "attempt", ("started", "started_at")],
        )
    click.echo("\nConsumers")
    table(
        view["consumers"],
        ["subject", "group", "consumer", "broker_group", "in_flight", "seen_s_ago", "alive"],
    )
