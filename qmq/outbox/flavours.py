"""Choosing a Producer's flavour from how it was told its database: `engine=`/`session=` is
SQLAlchemy (qmq/outbox/sqlalchemy_flavour.py), `using=` a Django alias. Django's flavour lives with
the Django app (qmq/contrib/django/flavour.py) and is imported only when asked for, so the outbox
needs no Django installed."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from qmq.outbox.flavour import Flavour
from qmq.outbox.sqlalchemy_flavour import SQLAlchemyFlavour


def choose(engine: sa.Engine | None, session: Any, using: str | None) -> Flavour:
    if using is not None:
        if engine is not None or session is not None:
            raise ValueError("a Producer uses Django's using= or SQLAlchemy's engine=/session=, not both")
        from qmq.contrib.django.flavour import DjangoFlavour

        return DjangoFlavour(using)
    if engine is None and session is None:
        raise ValueError("a Producer needs its database: engine=, session= or (Django) using=")
    return SQLAlchemyFlavour(engine, session)
