"""The PySpark reconciliation job (`qmq reconcile`, `spark-submit spark_etl/reconcile.py`): outbox rows
against the broker ledger and the consumers' idempotency records (docs/reconcile.md).

`settings` (what a run is asked), `session` (the SparkSession and the JDBC driver), `sources` (reading),
`classify` (deciding, DataFrames only), `report` (summary.json, report.md, the chart), `redrive`
(repairs), `job` (one run), `reconcile` (the spark-submit entry point).
"""
