"""A server's part in a replicated group, shared by brokers and delay servers (docs/replication.md):
its role and the switches between roles (`roles.py`), and a replica's fetcher (`fetcher.py`). The
store-level pieces they stand on (chunks, epochs, the master's side) are in `qmq/store/`."""
