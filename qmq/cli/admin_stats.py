"""`qmq admin stats` (broker groups, subjects and consumer groups with their figures and rates) and
`qmq admin inspect` (running workers: their consumers, concurrency, messages in flight)."""

from __future__ import annotations

from typing import Any

import click

from qmq.admin.views import stats_view, workers_view
from qmq.cli.admin_options import admin_client, admin_options, emit, table


@click.command("stats")
@admin_options
def stats(meta, brokers, delay_servers, token, as_json, log_level) -> None:
    """Per broker server: role, replicas and lag (when replicated), read-only; per subject: stored and
    the rate in; per subject and consumer group: backlog, in flight, retrying, dead, consumers and
    the rate out (messages per second over the last minute)."""
    with admin_client(meta, brokers, delay_servers, token, log_level) as admin:
        view = stats_view(admin.stats())
    emit(view, as_json, _render_stats)


def _render_stats(view: dict[str, Any]) -> None:
    click.echo("Broker servers")
    table(
        view["brokers"],
        [
            ("group", "group"),
            ("address", "address"),
            ("role", "role"),
            ("replicas", "replicas"),
            ("lag", "lag"),
            ("read-only", "read_only"),
            ("subjects", "subjects"),
        ],
    )
    click.echo("\nSubjects")
    table(
        view["subjects"],
        [("subject", "subject"), ("stored", "stored"), ("in/s", "in_rate"), ("consumer groups", "groups")],
    )
    click.echo("\nConsumer groups")
    table(
        view["groups"],
        [
            ("subject", "subject"),
            ("group", "group"),
            ("backlog", "backlog"),
            ("in flight", "in_flight"),
            ("retrying", "retrying"),
            ("dead", "dead"),
            ("consumers", "consumers"),
            ("acked", "acked"),
            ("out/s", "out_rate"),
        ],
    )


@click.command("inspect")
@admin_options
def inspect(meta, brokers, delay_servers, token, as_json, log_level) -> None:
    """Running workers (as `celery inspect active`): from the heartbeats the brokers receive, each
    worker's host, pid, pool and concurrency, its consumers and the messages it is running; then
    every consumer the brokers know, with the messages it holds."""
    with admin_client(meta, brokers, delay_servers, token, log_level) as admin:
        view = workers_view(admin.consumers())
    emit(view, as_json, _render_workers)


def _render_workers(view: dict[str, Any]) -> None:
    click.echo("Workers")
    table(
        view["workers"],
        [
            ("consumer", "consumer"),
            ("app", "app"),
            ("host", "host"),
            ("pid", "pid"),
            ("pool", "pool"),
            ("concurrency", "concurrency"),
            ("in flight", "in_flight"),
            ("reported s ago", "reported_s_ago"),
        ],
        empty="(no worker reported in its heartbeats)",
    )
    running = [{"consumer": w["consumer"], **r} for w in view["workers"] for r in w["running"] if isinstance(r, dict)]
    if running:
        click.echo("\nRunning")
        table(
            running,
            [
                ("consumer", "consumer"),
                ("subject", "subject"),
                ("group", "group"),
                ("id", "id"),
                ("attempt", "attempt"),
                ("started", "started_at"),
            ],
        )
    click.echo("\nConsumers")
    table(
        view["consumers"],
        [
            ("subject", "subject"),
            ("group", "group"),
            ("consumer", "consumer"),
            ("broker group", "broker_group"),
            ("in flight", "in_flight"),
            ("seen s ago", "seen_s_ago"),
            ("alive", "alive"),
        ],
    )
