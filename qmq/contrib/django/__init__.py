"""qmq for Django projects: add "qmq.contrib.django" to INSTALLED_APPS and run `manage.py migrate`
(on each database alias that holds an outbox) to get the outbox table; then
`qmq.Producer(meta=..., using="default")` and `@qmq.transactional(producer)` (a `transaction.atomic`
block on that alias) or any `atomic` block of your own.

The tables come from the same definitions as qmq's Alembic migrations (`qmq db upgrade`); use one or
the other on a database, not both.
"""
