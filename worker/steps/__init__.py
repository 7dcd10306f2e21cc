"""The steps around a handler, in the manner of Dramatiq's middleware: the protocol in step.py, one
module per step (retry, idempotency, time_limit, metrics, hooks, log, transaction). Their order is
set in worker/pipeline.py."""
