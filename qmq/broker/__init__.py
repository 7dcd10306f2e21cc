"""The real-time broker behind `qmq broker`: stores messages in the log store and serves consumer
groups through pull logs (QMQ's consumption model). Being built with the broker issue."""
