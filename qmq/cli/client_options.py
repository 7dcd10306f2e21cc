"""Options shared by the commands that act as a client (`qmq send`, `qmq tail`): where the servers
are, the token, the log level, and making the `Client` from them."""

from __future__ import annotations

from typing import Any

import click

from qmq.cli.net_options import tls_client_options
from qmq.cli.options import (
    brokers_option,
    choose_meta,
    log_level_option,
    meta_option,
    setup_logging,
    stacked,
    token_option,
)
from qmq.client import Client

client_options = stacked(tls_client_options, meta_option(), brokers_option(), token_option(), log_level_option())
"""--meta, --broker, --token and --log-level, in that order in --help."""


def make_client(
    meta: str | None, brokers: tuple[str, ...], token: str | None, log_level: str, **settings: Any
) -> Client:
    """The client for a command (`settings` go to `Client`); bad addresses are usage errors."""
    setup_logging(log_level)
    meta = choose_meta(meta, brokers)
    try:
        return Client(meta=meta, brokers=list(brokers) or None, token=token or None, **settings)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
