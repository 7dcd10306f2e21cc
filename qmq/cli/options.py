"""The options several commands share, defined once: where the servers are (--meta, --broker,
--delay-server), the token, the log level, metrics, and a server's own --host/--port. Each is a
function so a command can word its help for what the option means there; the rule for --meta
against --broker lives in `choose_meta`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import click

from qmq.client.routes import DEFAULT_META_ADDRESS, META_ENV
from qmq.net.common import TOKEN_ENV

F = TypeVar("F", bound=Callable[..., Any])
Decorator = Callable[[F], F]
SERVER_LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
CLIENT_LOG_FORMAT = "qmq %(levelname)s %(name)s: %(message)s"
META_HELP = f"meta server [env {META_ENV}; default {DEFAULT_META_ADDRESS}]"
CLIENTS_TOKEN_HELP = f"token clients must present [env {TOKEN_ENV}]"
POSITIVE_SECONDS = click.FloatRange(min=0, min_open=True)  # a duration in seconds, more than none


def stacked(*options: Decorator) -> Decorator:
    """Several options as one decorator, in the order given (which is their order in --help)."""

    def apply(fn: F) -> F:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return apply


class FlagNamedOption(click.Option):
    """An option whose automatic environment variable is named after its flag, as the docs name it
    (`--serve-ahead` of `qmq broker`: QMQ_BROKER_SERVE_AHEAD), even when its parameter has another
    name (`ahead_window_s`); the parameter's name (QMQ_BROKER_AHEAD_WINDOW_S) is still read after it.
    Every option of the `qmq` commands is one (`name_env_after_flags`)."""

    def resolve_envvar_value(self, ctx: click.Context) -> str | None:
        if self.envvar is None and self.allow_from_autoenv and ctx.auto_envvar_prefix is not None:
            flag = max(self.opts, key=len).lstrip("-").replace("-", "_").upper()
            value = os.environ.get(f"{ctx.auto_envvar_prefix}_{flag}")
            if value:
                return value
        return super().resolve_envvar_value(ctx)


def name_env_after_flags(command: click.Command) -> None:
    """Make every plain option of `command` and of its subcommands a `FlagNamedOption`, so that
    `QMQ_<COMMAND>_<FLAG>` sets it whatever its parameter is called (`--queues` of `qmq worker`
    fills `subjects`: QMQ_WORKER_QUEUES). The class only changes how the variable is looked up."""
    for param in command.params:
        if type(param) is click.Option:
            param.__class__ = FlagNamedOption
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            name_env_after_flags(sub)


def tuning(
    flag: str, kind: click.ParamType, default: Any, help: str, dest: str | None = None, **extra: Any
) -> Decorator:
    """A setting with a typed value whose default --help shows; `dest` names its parameter."""
    names = (flag, dest) if dest else (flag,)
    return click.option(*names, type=kind, default=default, show_default=True, help=help, **extra)


def meta_option(help: str = META_HELP) -> Decorator:
    return click.option("--meta", envvar=META_ENV, default=None, metavar="HOST:PORT", help=help)


def brokers_option(help: str = "a broker to use directly, without a meta server (repeat for several)") -> Decorator:
    return click.option("--broker", "brokers", multiple=True, metavar="HOST:PORT", help=help)


def delay_servers_option(help: str) -> Decorator:
    return click.option("--delay-server", "delay_servers", multiple=True, metavar="HOST:PORT", help=help)


def token_option(help: str = f"token the servers expect [env {TOKEN_ENV}]") -> Decorator:
    return click.option("--token", envvar=TOKEN_ENV, default=None, help=help)


def log_level_option(default: str = "WARNING", help: str = "DEBUG, INFO, WARNING or ERROR (to stderr)") -> Decorator:
    return click.option("-l", "--log-level", default=default, show_default=True, help=help)


def metrics_port_option(help: str = "serve Prometheus metrics here") -> Decorator:
    return click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, help=help)


def serving_options() -> Decorator:
    """What every server takes beside its address: the token its clients must present, and where
    it serves its metrics."""
    return stacked(token_option(CLIENTS_TOKEN_HELP), metrics_port_option())


def listen_options(default_host: str, default_port: int, port_help: str | None = None) -> Decorator:
    """A server's --host and --port."""
    return stacked(
        click.option("--host", default=default_host, show_default=True, help="address to listen on"),
        click.option("--port", type=click.IntRange(0, 65535), default=default_port, show_default=True, help=port_help),
    )


def choose_meta(meta: str | None, brokers: tuple[str, ...] | list[str]) -> str | None:
    """--meta and --broker exclude each other, except that --broker wins over a meta server that
    came from the environment."""
    if meta and brokers:
        if click.get_current_context().get_parameter_source("meta") is not click.core.ParameterSource.ENVIRONMENT:
            raise click.UsageError("give --meta or --broker, not both")
        return None
    return meta or None


def setup_logging(level: str, server: bool = False) -> None:
    logging.basicConfig(level=level.upper(), format=SERVER_LOG_FORMAT if server else CLIENT_LOG_FORMAT)
