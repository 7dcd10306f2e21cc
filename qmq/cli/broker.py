"""`qmq broker`: run a broker (message store, consumer groups, retries, dead letters; docs/broker.md)."""

from __future__ import annotations

import logging

import click

from qmq.broker.core import DEFAULT_CONSUMER_TIMEOUT_S, DEFAULT_MAX_ATTEMPTS
from qmq.broker.server import DEFAULT_HOST, DEFAULT_PORT, run
from qmq.net.common import TOKEN_ENV
from qmq.store.flush import DEFAULT_ASYNC_INTERVAL_MS
from qmq.store.store import StoreError

# Shared with `qmq delay-server`.
ADVERTISE_EXTERNAL = click.option(
    "--advertise-external",
    default=None,
    help="host:port clients outside the servers' network should use (the meta server's external listener "
    "hands it out; docs/meta.md) [default: the --advertise address]",
)


@click.command("broker")
@click.option("--data-dir", required=True, type=click.Path(file_okay=False), help="the broker's store directory")
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="address to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True)
@click.option("--meta", envvar="QMQ_META", default=None, help="meta server host:port [env QMQ_META]; none: serve alone")
@click.option("--group", default=None, help="broker group name [default: broker-PORT]")
@click.option("--advertise", default=None, help="host:port clients should use [default: HOST:PORT]")
@ADVERTISE_EXTERNAL
@click.option(
    "--flush",
    type=click.Choice(["sync", "async"]),
    default="sync",
    show_default=True,
    help=f"sync: reply after fsync (group commit); async: fsync every {DEFAULT_ASYNC_INTERVAL_MS} ms",
)
@click.option("--token", envvar=TOKEN_ENV, default=None, help=f"token clients must present [env {TOKEN_ENV}]")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, help="serve Prometheus metrics here")
@click.option(
    "--consumer-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_CONSUMER_TIMEOUT_S,
    show_default=True,
    help="seconds of silence after which a consumer's unacked messages go to others",
)
@click.option(
    "--max-attempts",
    type=click.IntRange(1),
    default=DEFAULT_MAX_ATTEMPTS,
    show_default=True,
    help="attempts before a message is dead-lettered, unless the consumer says otherwise",
)
@click.option("-l", "--log-level", default="INFO", show_default=True, help="DEBUG, INFO, WARNING or ERROR")
def broker(
    data_dir: str,
    host: str,
    port: int,
    meta: str | None,
    group: str | None,
    advertise: str | None,
    advertise_external: str | None,
    flush: str,
    token: str | None,
    metrics_port: int | None,
    consumer_timeout: float,
    max_attempts: int,
    log_level: str,
) -> None:
    """Run a broker: stores messages and serves them to consumer groups."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run(
            data_dir,
            host=host,
            port=port,
            meta=meta,
            group=group,
            advertise=advertise,
            advertise_external=advertise_external,
            flush=flush,
            token=token or None,
            metrics_port=metrics_port,
            consumer_timeout_s=consumer_timeout,
            max_attempts=max_attempts,
        )
    except StoreError as exc:
        raise click.ClickException(f"cannot open the store in {data_dir}: {exc}") from None
    except OSError as exc:
        raise click.ClickException(f"cannot start the broker: {exc}") from None
