"""The transactional outbox: messages written in the application's own database transaction, shipped
after commit by the in-process sender and, for whatever a crash or an outage left behind, by the relay."""
