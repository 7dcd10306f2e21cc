"""`qmq demo`: the end-to-end demo on the embedded cluster (qmq/demo/run.py)."""

from __future__ import annotations

import sys

import click


@click.command("demo")
@click.option(
    "--orders", type=click.IntRange(10, 100_000), default=200, show_default=True, help="orders the shop places"
)
@click.option("--keep", is_flag=True, help="keep the cluster's directory (stores, logs, ledger, report)")
@click.option(
    "--tls", is_flag=True, help="run the cluster with TLS (a certificate made for the session, as qmq dev --tls)"
)
def demo(orders: int, keep: bool, tls: bool) -> None:
    """Orders with @qmq.transactional, workers, delays, retries, dead letters, a crash, then the reconciliation."""
    from qmq.demo.run import run_demo

    sys.exit(run_demo(orders, keep=keep, tls=tls))
