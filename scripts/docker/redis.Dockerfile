# Redis 7 from Debian's packages on the local base image, standing in for the official redis:7 where no
# image registry is reachable (scripts/docker/local.yml).
ARG BASE_IMAGE=qmq-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/*
USER redis
WORKDIR /var/lib/redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
