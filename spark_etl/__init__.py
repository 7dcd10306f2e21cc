"""The PySpark reconciliation job (`qmq reconcile`, `spark-submit spark_etl/reconcile.py`): outbox rows
against the broker ledger. Arrives with the reconciliation issue."""
