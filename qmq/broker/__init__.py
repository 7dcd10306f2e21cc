"""The real-time broker behind `qmq broker`: stores messages in the log store and serves consumer
groups through pull logs (QMQ's consumption model). docs/broker.md names its modules."""
