"""Workers of a Django project (`qmq.App(name, using=alias)`): each message's handler and its
idempotency record run in one `transaction.atomic(using=alias)` block, so the handler uses the ORM
as anywhere else in the project, and its writes and the record commit together or not at all.

As Celery's Django support does, connections past their `CONN_MAX_AGE` (or broken) are closed before
each message: a worker is long-lived, and Django closes connections only at the end of a request.
Set `CONN_MAX_AGE` (e.g. 60) for worker processes to keep connections between messages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from django.db import close_old_connections, connections, transaction

from qmq.contrib.django.engine import engine_for_alias


class DjangoHandlerTransaction:
    """A message's `atomic` block, as the worker's steps see it (worker/database.py)."""

    connection = None  # no SQLAlchemy connection: the ORM and `cursor()` write in the block
    session = None

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.rolled_back = False

    def cursor(self) -> contextlib.AbstractContextManager[Any]:
        return connections[self.alias].cursor()

    def rollback_only(self) -> None:
        self.rolled_back = True


class DjangoDatabase:
    """`ConsumerDatabase` over one Django database alias."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self._engine: sa.Engine | None = None

    @contextlib.contextmanager
    def transaction(self, with_session: bool) -> Iterator[DjangoHandlerTransaction]:
        _ensure_setup()
        close_old_connections()
        with transaction.atomic(using=self.alias):
            handler_transaction = DjangoHandlerTransaction(self.alias)
            yield handler_transaction
            if handler_transaction.rolled_back:
                transaction.set_rollback(True, using=self.alias)

    def engine(self) -> sa.Engine:
        if self._engine is None:
            _ensure_setup()
            self._engine = engine_for_alias(self.alias)
        return self._engine


def _ensure_setup() -> None:
    """`django.setup()` if the project's module did not call it (it needs DJANGO_SETTINGS_MODULE)."""
    from django.apps import apps

    if not apps.ready:
        import django

        django.setup()
