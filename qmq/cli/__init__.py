"""The `qmq` command. Each command group lives in its own module; this one only assembles them.

Settings come from flags, then `QMQ_*` environment variables, then defaults.
"""

from __future__ import annotations

import click

from qmq import __version__
from qmq.cli.admin import admin
from qmq.cli.broker import broker
from qmq.cli.console import console
from qmq.cli.db import db
from qmq.cli.delay_server import delay_server
from qmq.cli.demo import demo
from qmq.cli.dev import dev
from qmq.cli.ledger import ledger
from qmq.cli.log import log
from qmq.cli.meta import meta
from qmq.cli.reconcile import reconcile
from qmq.cli.relay import relay
from qmq.cli.send import send
from qmq.cli.tail import tail
from qmq.cli.worker import worker


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "QMQ"})
@click.version_option(__version__, prog_name="qmq")
def main() -> None:
    """qmq: reliable, database-backed messaging."""


main.add_command(log)
main.add_command(ledger)
main.add_command(reconcile)
main.add_command(meta)
main.add_command(db)
main.add_command(broker)
main.add_command(send)
main.add_command(tail)
main.add_command(worker)
main.add_command(relay)
main.add_command(delay_server)
main.add_command(dev)
main.add_command(demo)
main.add_command(admin)
main.add_command(console)
