# One image for every qmq service of docker-compose.yml: meta server, brokers, delay server, relay,
# workers and the nightly reconciliation (Java and the PostgreSQL JDBC driver are for Spark).
#
# BASE_IMAGE: any Debian 12 image with Python 3.11 and its venv module. The default is the official
# one; machines without an image registry build qmq-base:bookworm from Debian's packages instead
# (scripts/docker-base.sh) and pass it: tests/compose/docker-compose.local.yml.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# qmq's wheel with its compiled parts (setup.py: the log store's loops, ids, the send path), built in a
# stage of its own so that the image carries no compiler.
FROM ${BASE_IMAGE} AS wheel
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev zlib1g-dev \
 && { python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
      || DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-dev; } \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/build && /opt/build/bin/pip install --no-cache-dir "setuptools>=68" wheel "Cython>=3.0,<4"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY qmq ./qmq
COPY worker ./worker
COPY delay_server ./delay_server
COPY spark_etl ./spark_etl
COPY migrations ./migrations
RUN /opt/build/bin/pip wheel --no-cache-dir --no-build-isolation --no-deps -w /wheels . \
 && /opt/build/bin/python -c 'import glob, sys, zipfile; sys.exit(not any("_speedups" in n for n in zipfile.ZipFile(glob.glob("/wheels/qmq-*.whl")[0]).namelist()))'

FROM ${BASE_IMAGE}

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      openjdk-17-jre-headless libpostgresql-jdbc-java procps \
 && rm -rf /var/lib/apt/lists/*

# qmq lives in its own virtualenv (Debian's Python refuses `pip install` outside one: PEP 668); its
# bin/ comes first on PATH, so `qmq` and `python` are the venv's in both kinds of base image.
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv "$VIRTUAL_ENV" && pip install --no-cache-dir "setuptools>=68" wheel

WORKDIR /opt/qmq
# Dependencies first, from pyproject.toml alone (empty packages and an empty README stand in for
# the code and the text), so that a change to either rebuilds only the last, small layers.
COPY pyproject.toml ./
RUN mkdir -p qmq worker delay_server spark_etl migrations \
 && touch README.md qmq/__init__.py worker/__init__.py delay_server/__init__.py spark_etl/__init__.py migrations/__init__.py \
 && pip install --no-cache-dir --no-build-isolation ".[spark,django,flask,celery]" "psycopg[binary]>=3.1,<4" "redis>=5,<7" \
 && pip uninstall -y qmq && rm -rf qmq worker delay_server spark_etl migrations build
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/qmq-*.whl && rm -rf /wheels \
 && python -c 'from qmq import ids; from qmq.broker import sending; from qmq.client import messages; from qmq.store import speedups; assert speedups.COMPILED and ids.compiled and sending.compiled and messages.compiled, speedups.describe()'

# Servers bind 127.0.0.1 by default; docker-compose.yml passes --host 0.0.0.0.
ENTRYPOINT ["qmq"]
CMD ["--help"]
