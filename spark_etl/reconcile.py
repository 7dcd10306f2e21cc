"""The reconciliation as a Spark application: `spark-submit [--master URL] spark_etl/reconcile.py
--outbox-db URL --ledger DIR --out DIR [...]`, with the options and exit codes of `qmq reconcile`
(qmq/cli/reconcile.py, docs/reconcile.md). No master is set here: spark-submit's applies. The
driver's Python needs qmq installed (`pip install 'qmq[spark]'`); executors need nothing but Spark.
"""

from qmq.cli.reconcile import reconcile

if __name__ == "__main__":
    reconcile(prog_name="spark_etl/reconcile.py")
