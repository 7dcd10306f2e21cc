"""qmq against its peers: the same workload on qmq, RabbitMQ, NATS JetStream, Redis Streams and Celery
on Redis, on this machine in one run. Not run in CI; start it with `python -m bench.peers.run`.

Modules: `workload` (the workload and its drivers), one module per system (`qmq_broker`, `rabbitmq`,
`nats_jetstream`, `redis_streams`, `celery_redis` with its app `celery_app`), `report` (table, ratios,
chart, Markdown) and `run` (the command line).
"""
