"""The broker ledger: what a broker's (or delay server's) store says happened to every message, as
Parquet tables for the nightly reconciliation (`qmq ledger export`, docs/reconcile.md).

`tables` (the layout), `replay` and `delayed` (store records to rows, no I/O), `writer` (Parquet,
partitioned by date), `export` (reading a store directory, live or not).
"""
