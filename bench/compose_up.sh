#!/usr/bin/env bash
# Wall time of `docker-compose up -d --build` on the local images (scripts/docker/local.yml), until
# every long-running service is healthy, then `down -v`. Starts a Docker daemon (as root, with the
# flags tests/support/compose.py uses) when none answers, and stops it at the end.
#   bash bench/compose_up.sh            # warm: the images exist (build from cache)
#   bash bench/compose_up.sh --cold     # cold: qmq's, PostgreSQL's and Redis's images removed first
#   bash bench/compose_up.sh --cold-base  # colder: the debootstrapped base image too
# Host ports 3xxxx are used so that a running `qmq dev` or a local PostgreSQL is not in the way.
set -euo pipefail
cd "$(dirname "$0")/.."
PROJECT=qmqbench
COMPOSE=(docker-compose -p "$PROJECT" -f docker-compose.yml -f scripts/docker/local.yml)
SERVICES=(postgres redis meta broker-a broker-b broker-a-replica broker-b-replica delay delay-replica relay worker)
export QMQ_HOST_PORT_META=30880 QMQ_HOST_PORT_BROKER_A=30881 QMQ_HOST_PORT_BROKER_B=30882
export QMQ_HOST_PORT_BROKER_A_REPLICA=30883 QMQ_HOST_PORT_BROKER_B_REPLICA=30884
export QMQ_HOST_PORT_DELAY=30890 QMQ_HOST_PORT_DELAY_REPLICA=30891
export QMQ_HOST_PORT_POSTGRES=35433 QMQ_HOST_PORT_REDIS=36380
export QMQ_COMPOSE_NETWORK=$PROJECT-net

mode=${1:-warm}
if [ "$mode" = --cold ] || [ "$mode" = --cold-base ]; then
    docker rmi -f qmq:dev qmq-postgres:local qmq-redis:local >/dev/null 2>&1 || true
    [ "$mode" = --cold-base ] && { docker rmi -f qmq-base:bookworm >/dev/null 2>&1 || true; }
    docker image prune -f --filter label=qmq.recipe >/dev/null
fi
dockerd_pid=
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || { echo "no Docker daemon answers and dockerd is missing" >&2; exit 1; }
    dockerd --iptables=false --ip-masq=false --bridge=none >"${TMPDIR:-/tmp}/qmqbench-dockerd.log" 2>&1 &
    dockerd_pid=$!
    for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done  # polling the daemon's start
    docker info >/dev/null 2>&1 || { echo "dockerd did not answer within 60 s" >&2; exit 1; }
fi
cleanup() {
    "${COMPOSE[@]}" down -v >/dev/null 2>&1 || true
    if [ -n "$dockerd_pid" ]; then kill "$dockerd_pid" 2>/dev/null; wait "$dockerd_pid" 2>/dev/null; fi
}
trap cleanup EXIT

healthy() {
    local ids
    ids=$("${COMPOSE[@]}" ps -q "${SERVICES[@]}" 2>/dev/null) || return 1
    [ "$(echo "$ids" | wc -w)" = "${#SERVICES[@]}" ] || return 1
    [ -z "$(docker inspect -f '{{.State.Health.Status}}' $ids | grep -v '^healthy$')" ]
}

start=$(date +%s.%N)
if [ "$mode" = --cold-base ]; then
    bash scripts/docker-base.sh >/dev/null
fi
base_done=$(date +%s.%N)
"${COMPOSE[@]}" up -d --build >/dev/null 2>&1
up_done=$(date +%s.%N)
until healthy; do sleep 0.5; done  # polling containers' health: nothing to await from outside
end=$(date +%s.%N)
awk -v m="$mode" -v s="$start" -v b="$base_done" -v u="$up_done" -v e="$end" 'BEGIN {
    printf "%s: base image %.1f s, up -d --build %.1f s, all healthy %.1f s after the start\n", m, b - s, u - b, e - s }'
