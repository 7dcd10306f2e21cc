"""`python -m qmq` is the `qmq` command."""

from qmq.cli import main

main()
