"""qmq's Alembic environment and revisions, shipped as a package so `qmq db upgrade` finds them in an
installed distribution. Run them with `qmq db upgrade --db URL` or `qmq.db.migrate.upgrade(url)`."""
