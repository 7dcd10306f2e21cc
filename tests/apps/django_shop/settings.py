"""Settings of the sample Django project: its database comes from $SHOP_DB_URL (PostgreSQL)."""

from __future__ import annotations

import os

import sqlalchemy as sa

_db = sa.engine.make_url(os.environ["SHOP_DB_URL"])

SECRET_KEY = "sample-project-only"
USE_TZ = True
INSTALLED_APPS = ["qmq.contrib.django", "tests.apps.django_shop.shop"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.database,
        "USER": _db.username or "",
        "PASSWORD": _db.password or "",
        "HOST": _db.host or "",
        "PORT": str(_db.port or ""),
        "CONN_MAX_AGE": 60,  # worker processes keep their connections between messages
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
