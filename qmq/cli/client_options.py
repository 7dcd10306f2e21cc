"""Options shared by the commands that act as a client (`qmq send`, `qmq tail`): where the servers
are, the token, the log level, and making the `Client` from them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import click

from qmq.cli.net_options import tls_client_options
from qmq.client import Client
from qmq.client.routes import DEFAULT_META_ADDRESS, META_ENV
from qmq.net.common import TOKEN_ENV

F = TypeVar("F", bound=Callable[..., Any])


def client_options(fn: F) -> F:
    """--meta, --broker, --token and --log-level, in that order in --help."""
    for option in reversed(
        [
            click.option(
                "--meta",
                envvar=META_ENV,
                default=None,
                metavar="HOST:PORT",
                help=f"meta server [env {META_ENV}; default {DEFAULT_META_ADDRESS}]",
            ),
            click.option(
                "--broker",
                "brokers",
                multiple=True,
                metavar="HOST:PORT",
                help="a broker to use directly, without a meta server (repeat for several)",
            ),
            click.option("--token", envvar=TOKEN_ENV, default=None, help=f"token the servers expect [env {TOKEN_ENV}]"),
            click.option(
                "-l",
                "--log-level",
                default="WARNING",
                show_default=True,
                help="DEBUG, INFO, WARNING or ERROR (logged to stderr)",
            ),
        ]
    ):
        fn = option(fn)
    return tls_client_options(fn)


def make_client(
    meta: str | None, brokers: tuple[str, ...], token: str | None, log_level: str, **settings: Any
) -> Client:
    """The client for a command (`settings` go to `Client`); bad addresses are usage errors."""
    logging.basicConfig(level=log_level.upper(), format="qmq %(levelname)s %(name)s: %(message)s")
    if meta and brokers:
        source = click.get_current_context().get_parameter_source("meta")
        if source is not click.core.ParameterSource.ENVIRONMENT:
            raise click.UsageError("give --meta or --broker, not both")
        meta = None  # --broker wins over a meta server that came from the environment
    try:
        return Client(meta=meta or None, brokers=list(brokers) or None, token=token or None, **settings)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
