"""The `qmq` command. Each command group lives in its own module; this one only names them.

A command's module is imported only when that command runs (or help lists it): `qmq broker` does not
load SQLAlchemy, Alembic or Spark's helpers, which took most of a second of every server's start.

Settings come from flags, then `QMQ_*` environment variables, then defaults.
"""

from __future__ import annotations

import importlib

import click

from qmq import __version__
from qmq.cli import options
from qmq.stacks import stacks_on_signal

# command name -> "module:attribute" of its click command
COMMANDS = {
    "admin": "qmq.cli.admin:admin",
    "broker": "qmq.cli.broker:broker",
    "console": "qmq.cli.console:console",
    "db": "qmq.cli.db:db",
    "delay-server": "qmq.cli.delay_server:delay_server",
    "demo": "qmq.cli.demo:demo",
    "dev": "qmq.cli.dev:dev",
    "ledger": "qmq.cli.ledger:ledger",
    "log": "qmq.cli.log:log",
    "meta": "qmq.cli.meta:meta",
    "reconcile": "qmq.cli.reconcile:reconcile",
    "relay": "qmq.cli.relay:relay",
    "send": "qmq.cli.send:send",
    "tail": "qmq.cli.tail:tail",
    "worker": "qmq.cli.worker:worker",
}


class LazyGroup(click.Group):
    """A group whose commands are imported when looked up (click's documented lazy-loading pattern)."""

    def __init__(self, *args, lazy_commands: dict[str, str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy_commands:
            module, attribute = self.lazy_commands[cmd_name].split(":")
            command = getattr(importlib.import_module(module), attribute)
            if command.name != cmd_name:
                raise RuntimeError(f"{self.lazy_commands[cmd_name]} is the command {command.name!r}, not {cmd_name!r}")
            options.name_env_after_flags(command)
            self.add_command(command)
        return super().get_command(ctx, cmd_name)


@click.group(
    cls=LazyGroup,
    lazy_commands=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "QMQ"},
)
@click.version_option(__version__, prog_name="qmq")
def main() -> None:
    """qmq: reliable, database-backed messaging."""
    stacks_on_signal()
