# PostgreSQL 15 from Debian's packages on the local base image, standing in for the official postgres:15
# where no image registry is reachable (scripts/docker/local.yml). The entrypoint keeps the part of the
# official image's contract that docker-compose.yml uses: POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB
# and the *.sql files of /docker-entrypoint-initdb.d, run once when the data volume is new.
ARG BASE_IMAGE=qmq-base:bookworm
FROM ${BASE_IMAGE}

# No "main" cluster from the package: the entrypoint makes the one in $PGDATA.
RUN mkdir -p /etc/postgresql-common \
 && echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-15 \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /var/lib/postgresql/data /var/run/postgresql /docker-entrypoint-initdb.d \
 && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql

ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
USER postgres
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["postgres-entrypoint.sh"]
CMD ["postgres"]
