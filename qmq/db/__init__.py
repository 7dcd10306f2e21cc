"""qmq's own SQL tables: database URLs, engines and the Alembic migrations that create the tables."""
