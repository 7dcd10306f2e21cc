"""The SparkSession of a reconciliation: the PostgreSQL JDBC driver on its class path, UTC times,
and no master of its own unless asked (so `spark-submit --master ...` decides).

The driver is Debian's `libpostgresql-jdbc-java` (/usr/share/java/postgresql.jar), or the jar named
by `$QMQ_JDBC_JAR`; Maven is not consulted. A missing jar is an error naming the package. Under
spark-submit the driver JVM is already running, so the jar must come with `--jars`: a job that
cannot load the driver class says so.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEBIAN_JDBC_JAR = Path("/usr/share/java/postgresql.jar")
JDBC_JAR_ENV = "QMQ_JDBC_JAR"
JDBC_PACKAGE = "libpostgresql-jdbc-java"
JDBC_DRIVER_CLASS = "org.postgresql.Driver"
APP_NAME = "qmq-reconcile"
LOCAL_SHUFFLE_PARTITIONS = 8  # Spark's 200 is made for clusters; adaptive execution coalesces further


PLAN_FIELDS_SHOWN = 200  # the job's plans are wide: do not warn that they are shown truncated
LOCAL_MASTER = "local[*]"
SPARK_SUBMIT_GATEWAY_ENV = "PYSPARK_GATEWAY_PORT"  # set by spark-submit for the Python driver it starts


class JdbcDriverMissing(RuntimeError):
    pass


def default_master() -> str | None:
    """local[*], except under spark-submit, whose --master (or configuration) decides."""
    return None if os.environ.get(SPARK_SUBMIT_GATEWAY_ENV) else LOCAL_MASTER


def jdbc_jar() -> Path:
    """The PostgreSQL JDBC jar; JdbcDriverMissing naming the package when there is none."""
    chosen = os.environ.get(JDBC_JAR_ENV)
    path = Path(chosen) if chosen else DEBIAN_JDBC_JAR
    if not path.is_file():
        raise JdbcDriverMissing(
            f"the PostgreSQL JDBC driver is missing: no {path}. Install Debian's {JDBC_PACKAGE} "
            f"(apt-get install {JDBC_PACKAGE}) or set ${JDBC_JAR_ENV} to a postgresql-*.jar"
        )
    return path


def spark_session(master: str | None = None, *, driver_memory: str | None = None, conf: dict[str, str] | None = None):
    """The session to run in: the one already running (tests, spark-submit), or a new one. `master`
    None leaves it to spark-submit or to Spark's configuration; `conf` adds settings."""
    jar = jdbc_jar()
    from pyspark import SparkConf
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(APP_NAME)
    jars = [j for j in SparkConf().get("spark.jars", "").split(",") if j]  # spark-submit --jars
    if str(jar) not in jars:
        builder = builder.config("spark.jars", ",".join([*jars, str(jar)]))
    if master is not None:
        builder = builder.master(master)
        if master.startswith("local"):
            builder = builder.config("spark.sql.shuffle.partitions", str(LOCAL_SHUFFLE_PARTITIONS))
    if driver_memory is not None:
        builder = builder.config("spark.driver.memory", driver_memory)
    for key, value in {"spark.ui.showConsoleProgress": "false", **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    configure(spark)
    if not driver_loadable(spark):
        raise JdbcDriverMissing(
            f"the PostgreSQL JDBC driver is not on the Spark driver's class path (a Spark started before this "
            f"job cannot take it any more): with spark-submit, pass --jars {jar}"
        )
    return spark


def driver_loadable(spark) -> bool:
    """Whether the driver JVM can load the PostgreSQL JDBC driver (Spark resolves schemas there)."""
    jvm = spark.sparkContext._jvm
    try:
        jvm.java.lang.Class.forName(
            JDBC_DRIVER_CLASS, True, jvm.java.lang.Thread.currentThread().getContextClassLoader()
        )
    except Exception:
        return False
    return True


def configure(spark) -> None:
    """Settings the job relies on, whoever made the session."""
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    # Ledger partitions stay strings (a broker named "2" is not a number).
    spark.conf.set("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
    spark.conf.set("spark.sql.debug.maxToStringFields", str(PLAN_FIELDS_SHOWN))
    spark.sparkContext.setLogLevel("WARN")
