"""The consumer worker runtime behind `qmq worker` (Celery-like): pulls, runs handlers with retries,
dead letters and idempotency. Arrives with the workers issue."""
