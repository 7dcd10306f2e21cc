"""`qmq delay-server`: run a delay server (messages delivered at a time up to two years ahead;
docs/delay.md)."""

from __future__ import annotations

import logging

import click

from delay_server.schedule_log import BUCKET_MINUTES, DEFAULT_BUCKET_MINUTES, ScheduleError
from delay_server.scheduler import DEFAULT_LOAD_AHEAD_S, DEFAULT_RETENTION_S
from delay_server.server import DEFAULT_HOST, DEFAULT_PORT, run
from delay_server.service import DEFAULT_MAX_DELAY_S
from qmq.cli.broker import ADVERTISE_EXTERNAL
from qmq.cli.net_options import server_net_options
from qmq.net.common import TOKEN_ENV
from qmq.store.store import StoreError

DAY_S = 86400


@click.command("delay-server")
@server_net_options
@click.option("--data-dir", required=True, type=click.Path(file_okay=False), help="the delay server's directory")
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="address to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True)
@click.option(
    "--meta",
    envvar="QMQ_META",
    default=None,
    metavar="HOST:PORT",
    help="meta server [env QMQ_META]: register there and deliver to the brokers of its routes",
)
@click.option(
    "--broker",
    "brokers",
    multiple=True,
    metavar="HOST:PORT",
    help="deliver to this broker directly, without a meta server (repeat for several)",
)
@click.option("--advertise", default=None, help="host:port clients should use [default: HOST:PORT]")
@ADVERTISE_EXTERNAL
@click.option("--token", envvar=TOKEN_ENV, default=None, help=f"token clients must present [env {TOKEN_ENV}]")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, help="serve Prometheus metrics here")
@click.option(
    "--max-delay",
    type=click.FloatRange(min=1),
    default=DEFAULT_MAX_DELAY_S / DAY_S,
    show_default=True,
    metavar="DAYS",
    help="refuse messages due further ahead than this",
)
@click.option(
    "--bucket-minutes",
    type=click.Choice([str(m) for m in BUCKET_MINUTES]),
    default=str(DEFAULT_BUCKET_MINUTES),
    show_default=True,
    help="schedule-log bucket size (fixed when the data directory is created)",
)
@click.option(
    "--load-ahead",
    type=click.FloatRange(min=1),
    default=DEFAULT_LOAD_AHEAD_S,
    show_default=True,
    metavar="SECONDS",
    help="load a bucket into the wheel this long before it begins",
)
@click.option(
    "--retention",
    type=click.FloatRange(min=0),
    default=DEFAULT_RETENTION_S / 3600,
    show_default=True,
    metavar="HOURS",
    help="keep delivered buckets this long after they end",
)
@click.option(
    "--clock-file",
    envvar="QMQ_DELAY_CLOCK_FILE",
    default=None,
    type=click.Path(dir_okay=False),
    help="for tests: a file holding seconds to add to the clock, re-read when it changes",
)
@click.option("-l", "--log-level", default="INFO", show_default=True, help="DEBUG, INFO, WARNING or ERROR")
def delay_server(
    data_dir: str,
    host: str,
    port: int,
    meta: str | None,
    brokers: tuple[str, ...],
    advertise: str | None,
    advertise_external: str | None,
    token: str | None,
    metrics_port: int | None,
    max_delay: float,
    bucket_minutes: str,
    load_ahead: float,
    retention: float,
    clock_file: str | None,
    log_level: str,
) -> None:
    """Run a delay server: keeps delayed messages on disk and hands each to a broker when it is due."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if meta and brokers:
        raise click.UsageError("give --meta or --broker, not both")
    if not meta and not brokers:
        raise click.UsageError("give --meta (or QMQ_META) or --broker: the delay server needs brokers to deliver to")
    try:
        run(
            data_dir,
            host=host,
            port=port,
            meta=meta,
            brokers=brokers,
            advertise=advertise,
            advertise_external=advertise_external,
            token=token or None,
            metrics_port=metrics_port,
            max_delay_s=max_delay * DAY_S,
            bucket_minutes=int(bucket_minutes),
            load_ahead_s=load_ahead,
            retention_s=retention * 3600,
            clock_file=clock_file,
        )
    except (StoreError, ScheduleError) as exc:
        raise click.ClickException(f"cannot open the delay server's data in {data_dir}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot start the delay server: {exc}") from None
