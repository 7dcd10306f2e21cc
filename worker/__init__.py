"""The consumer worker runtime behind `qmq worker` (Celery-like): `qmq.App` and its consumers, a pull
loop within free capacity, a pool of threads or processes running each handler inside a chain of
steps (retry, idempotency, time limit, metrics, logging), late acknowledgements, warm and cold
shutdown, liveness. Start at worker/runner.py; the guide is docs/worker.md."""
