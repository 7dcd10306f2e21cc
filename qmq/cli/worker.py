"""`qmq worker -A module:app`: run the consumers of an app (Celery's `celery -A proj worker`).

The current directory is put on the import path first, as Celery does, so `-A myproject.app` works
from the project's root.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import click

from qmq.cli.options import POSITIVE_SECONDS, brokers_option, meta_option, metrics_port_option, token_option
from qmq.client.routes import META_ENV
from qmq.memory import collect_less, keep_large_buffers

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
FROM_HELP = (
    "where a consumer group new to a broker starts, for consumers that do not say (@app.consumer(start=)): "
    "earliest (every message the broker keeps) or latest (only messages stored from now on) [default: earliest]"
)


def _subjects(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(s.strip() for item in value for s in item.split(",") if s.strip())


@click.command("worker")
@click.option(
    "-A",
    "--app",
    "app_spec",
    required=True,
    metavar="MODULE:APP",
    help="the qmq.App to serve, e.g. billing.consumers:app",
)
@click.option(
    "-c",
    "--concurrency",
    type=click.IntRange(min=1),
    default=None,
    help="handlers at once [default: 8 threads, or one process per CPU]",
)
@click.option(
    "-P",
    "--pool",
    type=click.Choice(["threads", "processes", "solo"]),
    default="threads",
    show_default=True,
    help="where handlers run",
)
@click.option(
    "-Q",
    "--queues",
    "subjects",
    multiple=True,
    callback=_subjects,
    metavar="SUBJECT[,SUBJECT]",
    help="serve only these subjects' consumers [default: all of the app's]",
)
@click.option(
    "-n",
    "--hostname",
    default=None,
    metavar="NAME",
    help="node name, also the consumer id at the brokers (%h host, %n short host, %d domain, %p pid) "
    "[default: qmq-%p@%h]",
)
@click.option(
    "--prefetch-multiplier",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="messages held per free handler slot",
)
@meta_option(f"meta server [env {META_ENV}; default: the app's]")
@brokers_option()
@token_option()
@metrics_port_option("serve /metrics and /healthz on this port [default: none]")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="address for --metrics-port")
@click.option(
    "--liveness-timeout",
    "liveness_timeout_s",
    type=POSITIVE_SECONDS,
    default=60.0,
    show_default=True,
    metavar="SECONDS",
    help="unhealthy after this long with work waiting and no message finished",
)
@click.option("--from", "start", type=click.Choice(["earliest", "latest"]), default="earliest", help=FROM_HELP)
@click.option(
    "-l",
    "--loglevel",
    "--log-level",
    "log_level",
    default="WARNING",
    show_default=True,
    help="DEBUG, INFO, WARNING or ERROR (to stderr)",
)
def worker(app_spec: str, meta: str | None, brokers: tuple[str, ...], log_level: str, **options: Any) -> None:
    """Run the consumers of an app: pull, handle, acknowledge after the handler (and its transaction)
    finished. SIGTERM or Ctrl-C: warm shutdown (finish what was pulled, ack, exit 0); a second Ctrl-C
    or SIGQUIT: cold shutdown (stop now; what was not acked is delivered again)."""
    from worker.database import MissingTables
    from worker.loading import AppNotFound, load_app
    from worker.runner import DEFAULT_HOSTNAME, Worker, WorkerOptions

    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    keep_large_buffers()  # pulls of hundreds of messages (qmq/memory.py); the pool's children inherit it
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        app = load_app(app_spec)
    except AppNotFound as exc:
        raise click.UsageError(str(exc)) from None
    from_env = click.get_current_context().get_parameter_source("meta") is click.core.ParameterSource.ENVIRONMENT
    if meta and brokers and not from_env:
        raise click.UsageError("give --meta or --broker, not both")
    if meta and from_env and (brokers or app.meta or app.brokers):
        meta = None  # flags, then the app's own settings, win over $QMQ_META
    # The other options are the WorkerOptions of the same names.
    options["hostname"] = options["hostname"] or DEFAULT_HOSTNAME
    options["token"] = options["token"] or None
    settings = WorkerOptions(app_spec=app_spec, meta=meta or None, brokers=brokers, log_level=log_level, **options)
    try:
        runner = Worker(app, settings, on_ready=_announce)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    collect_less()  # after the app's modules were loaded: they are frozen with the rest (qmq/memory.py)
    try:
        code = runner.run()
    except MissingTables as exc:
        raise click.ClickException(f"cannot start the worker: {exc}") from None
    except OSError as exc:  # e.g. the metrics port is taken
        raise click.ClickException(f"cannot start the worker: {exc}") from None
    sys.exit(code)


def _announce(runner: object) -> None:
    from worker.runner import Worker

    assert isinstance(runner, Worker)
    consumers = ", ".join(f.consumer.name for f in runner.feeders)
    port = f", metrics and /healthz on port {runner.metrics_port}" if runner.metrics_port is not None else ""
    click.echo(
        f"qmq worker {runner.hostname} ready: {consumers} (pool {runner.options.pool}, concurrency "
        f"{runner.concurrency}{port})",
        err=True,
    )
