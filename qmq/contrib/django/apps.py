"""The Django app that carries qmq's tables (label "qmq")."""

from __future__ import annotations

from django.apps import AppConfig


class QmqConfig(AppConfig):
    name = "qmq.contrib.django"
    label = "qmq"
    verbose_name = "qmq messaging"
