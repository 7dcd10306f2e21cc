"""The broker ledger: what a broker's (or delay server's) store says happened to every message, as
Parquet tables for the nightly reconciliation (`qmq ledger export`, docs/reconcile.md).

`tables` (the layout), `replay` (a broker's records to rows, no I/O), `writer` (Parquet, partitioned
by date), `export` (reading a store directory, live or not). A delay server's rows are made by
`delay_server/ledger.py`.
"""
