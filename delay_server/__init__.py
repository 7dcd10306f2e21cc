"""The delay server behind `qmq delay-server`: a durable two-level hash wheel for messages due up to
two years ahead. Arrives with the delay-server issue."""
