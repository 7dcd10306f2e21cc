"""The delay server behind `qmq delay-server`: a durable two-level hash wheel (hour buckets on disk,
500 ms ticks in memory) for messages due up to two years ahead. See docs/delay.md."""
