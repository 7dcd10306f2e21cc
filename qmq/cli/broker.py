"""`qmq broker`: run a broker (message store, consumer groups, retries, dead letters; docs/broker.md)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import click

from qmq.broker.ahead import AHEAD_WINDOW_S
from qmq.broker.core import DEFAULT_CONSUMER_TIMEOUT_S, DEFAULT_MAX_ATTEMPTS
from qmq.broker.queue_lease import ORDERED_LEASE_S
from qmq.broker.server import DEFAULT_HOST, DEFAULT_PORT, run, store_config_for
from qmq.cli.net_options import server_net_options
from qmq.cli.options import CLIENTS_TOKEN_HELP as CLIENTS_TOKEN_HELP  # for `qmq delay-server`
from qmq.cli.options import (
    POSITIVE_SECONDS,
    listen_options,
    log_level_option,
    serving_options,
    setup_logging,
    tuning,
)
from qmq.cli.time_options import DURATION
from qmq.store.flush import DEFAULT_ASYNC_INTERVAL_MS
from qmq.store.followers import MAX_LAG_S
from qmq.store.message_log import DEFAULT_SEGMENT_BYTES
from qmq.store.store import DEFAULT_RETENTION_S, StoreError

MIB = 1024 * 1024
HOUR_S = 3600
LOG_RETENTION_HOURS = DEFAULT_RETENTION_S / HOUR_S
LOG_RETENTION_HELP = (
    "keep message-log segments this long (consumer positions outlive it in the consumption snapshot; "
    "a new replica copies that when the log it would need is gone)"
)
MAX_SEGMENT_MIB = 1024  # the default is the largest tried

ACK_REPLICAS_HELP = (
    "replicas that must hold a send durably before it is acknowledged [default: 1 when the group has a "
    "replica, else 0]; fewer in sync: the group answers sends READ_ONLY"
)
ORDERED_LEASE_HELP = "seconds a consumer's lease on an ordered subject's queue lasts unless renewed (docs/ordering.md)"
MAX_LAG_HELP = "a replica that has not caught up with the master for this long is out of sync (e.g. 5s, 500ms)"

# Shared with `qmq delay-server`.
ADVERTISE = click.option("--advertise", default=None, help="host:port clients should use [default: HOST:PORT]")
ADVERTISE_EXTERNAL = click.option(
    "--advertise-external",
    default=None,
    help="host:port clients outside the servers' network should use (the meta server's external listener "
    "hands it out; docs/meta.md) [default: the --advertise address]",
)
ACK_REPLICAS = click.option("--ack-replicas", type=click.IntRange(0), default=None, help=ACK_REPLICAS_HELP)
MAX_LAG = tuning("--max-lag", DURATION, f"{MAX_LAG_S:g}s", MAX_LAG_HELP)


def max_lag_seconds(max_lag: timedelta) -> float:
    """--max-lag in seconds; 0 or less would keep every replica out of sync, so the group read-only."""
    seconds = max_lag.total_seconds()
    if seconds <= 0:
        raise click.BadParameter(
            "must be longer than 0 (no replica would ever be in sync), e.g. 5s or 500ms", param_hint="'--max-lag'"
        )
    return seconds


@click.command("broker")
@server_net_options
@click.option("--data-dir", required=True, type=click.Path(file_okay=False), help="the broker's store directory")
@listen_options(DEFAULT_HOST, DEFAULT_PORT)
@click.option("--meta", envvar="QMQ_META", default=None, help="meta server host:port [env QMQ_META]; none: serve alone")
@click.option("--group", default=None, help="broker group name [default: broker-PORT]")
@ADVERTISE
@ADVERTISE_EXTERNAL
@click.option(
    "--flush",
    type=click.Choice(["sync", "async"]),
    default="sync",
    show_default=True,
    help=f"sync: reply after fsync (group commit); async: fsync every {DEFAULT_ASYNC_INTERVAL_MS} ms",
)
@serving_options()
@tuning(
    "--consumer-timeout",
    POSITIVE_SECONDS,
    DEFAULT_CONSUMER_TIMEOUT_S,
    "seconds of silence after which a consumer's unacked messages go to others",
    "consumer_timeout_s",
)
@tuning(
    "--serve-ahead",
    click.FloatRange(min=0),
    AHEAD_WINDOW_S,
    "seconds after a pull that asked for it (prefetch, the worker) during which new messages are served to its "
    "consumer ahead of its next pull, journalled with their send (0: never)",
    "ahead_window_s",
    metavar="SECONDS",
)
@tuning("--ordered-lease", click.FloatRange(min=1), ORDERED_LEASE_S, ORDERED_LEASE_HELP, "ordered_lease_s")
@tuning(
    "--max-attempts",
    click.IntRange(1),
    DEFAULT_MAX_ATTEMPTS,
    "attempts before a message is dead-lettered, unless the consumer says otherwise",
)
@ACK_REPLICAS
@MAX_LAG
@click.option(
    "--segment-mib",
    type=click.IntRange(1, MAX_SEGMENT_MIB),
    default=DEFAULT_SEGMENT_BYTES // MIB,
    show_default=True,
    help="size at which a message-log segment file is closed and the next begun (retention removes whole segments)",
)
@tuning(
    "--log-retention", click.FloatRange(min=0, min_open=True), LOG_RETENTION_HOURS, LOG_RETENTION_HELP, metavar="HOURS"
)
@log_level_option("INFO", "DEBUG, INFO, WARNING or ERROR")
def broker(data_dir: str, log_level: str, **settings: Any) -> None:
    """Run a broker: stores messages and serves them to consumer groups."""
    setup_logging(log_level, server=True)
    settings["token"] = settings["token"] or None
    settings["max_lag_s"] = max_lag_seconds(settings.pop("max_lag"))
    settings["store_config"] = store_config_for(
        settings.pop("segment_mib") * MIB, settings.pop("log_retention") * HOUR_S
    )
    try:
        run(data_dir, **settings)
    except StoreError as exc:
        raise click.ClickException(f"cannot open the store in {data_dir}: {exc}") from None
    except OSError as exc:
        raise click.ClickException(f"cannot start the broker: {exc}") from None
