"""The meta server (`qmq meta`): where broker groups and delay servers register and heartbeat, and
where producers and consumers learn which broker groups carry a subject. State lives in SQL
(qmq_meta_* tables, created by qmq's Alembic migrations); see docs/meta.md."""
