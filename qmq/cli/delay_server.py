"""`qmq delay-server`: run a delay server (messages delivered at a time up to two years ahead;
docs/delay.md)."""

from __future__ import annotations

from typing import Any

import click

from delay_server.schedule_log import BUCKET_MINUTES, DEFAULT_BUCKET_MINUTES, ScheduleError
from delay_server.scheduler import DEFAULT_LOAD_AHEAD_S, DEFAULT_MAX_HELD, DEFAULT_RETENTION_S
from delay_server.server import DEFAULT_HOST, DEFAULT_LOG_RETENTION_S, DEFAULT_PORT, STORE_CONFIG, run
from delay_server.service import DEFAULT_MAX_DELAY_S
from qmq.cli.broker import (
    ACK_REPLICAS,
    ADVERTISE,
    ADVERTISE_EXTERNAL,
    CLIENTS_TOKEN_HELP,
    MAX_LAG,
    MAX_SEGMENT_MIB,
    MIB,
    max_lag_seconds,
)
from qmq.cli.net_options import server_net_options
from qmq.cli.options import (
    brokers_option,
    listen_options,
    log_level_option,
    meta_option,
    metrics_port_option,
    setup_logging,
    token_option,
    tuning,
)
from qmq.store.store import StoreError

DAY_S = 86400
HOUR_S = 3600
MAX_DELAY_DAYS = DEFAULT_MAX_DELAY_S / DAY_S
RETENTION_HOURS = DEFAULT_RETENTION_S / HOUR_S
LOG_RETENTION_HOURS = DEFAULT_LOG_RETENTION_S / HOUR_S
LOG_RETENTION_HELP = (
    "keep message-log segments this long (pending messages stay in the buckets; a new replica copies "
    "those when the log it would need is gone)"
)
SEGMENT_MIB_HELP = (
    "size at which a message-log segment file is closed and the next begun (retention removes whole segments)"
)
BUCKET_CHOICES = [str(m) for m in BUCKET_MINUTES]
BUCKET_DEFAULT = str(DEFAULT_BUCKET_MINUTES)
LOAD_AHEAD_S = DEFAULT_LOAD_AHEAD_S
LOAD_AHEAD_HELP = "load a bucket into the wheel this long before it begins"
GROUP_HELP = (
    "join this replicated group (needs --meta): the meta server makes one delay server of the group "
    "master, the others replicas of its log (docs/replication.md) [default: none, a delay server alone]"
)
MAX_HELD_HELP = (
    "due messages read from disk and not yet delivered, at most; after an outage the rest of a backlog "
    "waits in the wheel at 8 bytes a message"
)
CLOCK_FILE_HELP = "for tests: a file holding seconds to add to the clock, re-read when it changes"


@click.command("delay-server")
@server_net_options
@click.option("--data-dir", required=True, type=click.Path(file_okay=False), help="the delay server's directory")
@listen_options(DEFAULT_HOST, DEFAULT_PORT)
@meta_option("meta server [env QMQ_META]: register there and deliver to the brokers of its routes")
@brokers_option("deliver to this broker directly, without a meta server (repeat for several)")
@click.option("--group", default=None, help=GROUP_HELP)
@ACK_REPLICAS
@MAX_LAG
@ADVERTISE
@ADVERTISE_EXTERNAL
@token_option(CLIENTS_TOKEN_HELP)
@metrics_port_option()
@tuning("--max-delay", click.FloatRange(min=1), MAX_DELAY_DAYS, "refuse messages due later than this", metavar="DAYS")
@tuning(
    "--bucket-minutes", click.Choice(BUCKET_CHOICES), str(DEFAULT_BUCKET_MINUTES), "bucket size (fixed at creation)"
)
@tuning(
    "--load-ahead", click.FloatRange(min=1), DEFAULT_LOAD_AHEAD_S, LOAD_AHEAD_HELP, "load_ahead_s", metavar="SECONDS"
)
@tuning("--max-held", click.IntRange(min=1), DEFAULT_MAX_HELD, MAX_HELD_HELP, metavar="MESSAGES")
@tuning("--retention", click.FloatRange(min=0), RETENTION_HOURS, "keep delivered buckets this long", metavar="HOURS")
@tuning("--segment-mib", click.IntRange(1, MAX_SEGMENT_MIB), STORE_CONFIG.segment_bytes // MIB, SEGMENT_MIB_HELP)
@tuning(
    "--log-retention", click.FloatRange(min=0, min_open=True), LOG_RETENTION_HOURS, LOG_RETENTION_HELP, metavar="HOURS"
)
@click.option("--clock-file", envvar="QMQ_DELAY_CLOCK_FILE", type=click.Path(dir_okay=False), help=CLOCK_FILE_HELP)
@log_level_option("INFO", "DEBUG, INFO, WARNING or ERROR")
def delay_server(
    data_dir: str,
    max_delay: float,
    bucket_minutes: str,
    retention: float,
    segment_mib: int,
    log_retention: float,
    log_level: str,
    **settings: Any,
) -> None:
    """Run a delay server: keeps delayed messages on disk and hands each to a broker when it is due."""
    setup_logging(log_level, server=True)
    if settings["meta"] and settings["brokers"]:
        raise click.UsageError("give --meta or --broker, not both")
    if not settings["meta"] and not settings["brokers"]:
        raise click.UsageError("give --meta (or QMQ_META) or --broker: the delay server needs brokers to deliver to")
    if settings["group"] and not settings["meta"]:
        raise click.UsageError("--group needs --meta: the meta server decides which member is master")
    settings["token"] = settings["token"] or None
    settings["max_lag_s"] = max_lag_seconds(settings.pop("max_lag"))
    try:
        run(
            data_dir,
            max_delay_s=max_delay * DAY_S,
            bucket_minutes=int(bucket_minutes),
            retention_s=retention * HOUR_S,
            segment_bytes=segment_mib * MIB,
            log_retention_s=log_retention * HOUR_S,
            **settings,
        )
    except (StoreError, ScheduleError) as exc:
        raise click.ClickException(f"cannot open the delay server's data in {data_dir}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot start the delay server: {exc}") from None
