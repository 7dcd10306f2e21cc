# One image for every qmq service of docker-compose.yml: meta server, brokers, delay server, relay,
# workers and the nightly reconciliation (Java and the PostgreSQL JDBC driver are for Spark).
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      openjdk-17-jre-headless libpostgresql-jdbc-java procps \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/qmq
COPY pyproject.toml README.md ./
COPY qmq ./qmq
COPY worker ./worker
COPY delay_server ./delay_server
COPY spark_etl ./spark_etl
COPY migrations ./migrations
RUN pip install --no-cache-dir ".[spark,django,flask,celery]" "psycopg[binary]>=3.1,<4" "redis>=5,<7"

# Servers bind 127.0.0.1 by default; in a container they must listen on every interface.
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["qmq"]
CMD ["--help"]
