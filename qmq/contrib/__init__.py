"""Integrations with the frameworks qmq's users run: Django (an app with the outbox's migrations and
its transaction flavour) and Celery (a beat task that runs one relay sweep)."""
