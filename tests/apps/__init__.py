"""Applications that tests run as real processes (Celery workers, qmq workers)."""
