#!/usr/bin/env bash
# Build the local base image qmq-base:bookworm from Debian's packages, for machines that reach Debian's
# archive but no image registry (tests/test_compose.py; tests/compose/README.md). It stands in for
# python:3.11-slim-bookworm: Debian 12 with Python 3.11, venv and CA certificates, nothing else.
#   debootstrap bookworm into .cache/docker-base/rootfs, then `docker import` it; the folder is removed.
# The image trusts the certificate authorities this machine's administrator added
# (/usr/local/share/ca-certificates, e.g. a proxy's), so that builds reach PyPI as the host's pip does.
# Idempotent: an existing image of the same recipe is kept (--force builds it again).
#   QMQ_DEBIAN_MIRROR   the Debian archive (default: the first deb.debian.org-style URI apt uses here)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
IMAGE=${QMQ_BASE_IMAGE:-qmq-base:bookworm}
SUITE=bookworm
PACKAGES=python3,python3-venv,ca-certificates
LOCAL_CAS=/usr/local/share/ca-certificates
cas_digest=$(find "$LOCAL_CAS" -type f -name '*.crt' -print0 2>/dev/null | sort -z | xargs -0 -r cat | sha1sum | cut -c1-12)
# Change "v3" to rebuild images made by an older version of this script; new local CAs rebuild too.
RECIPE="$SUITE minbase $PACKAGES v3 ca:$cas_digest"
WORK=$ROOT/.cache/docker-base
ROOTFS=$WORK/rootfs

say() { printf '[docker-base] %s\n' "$*"; }
die() { printf '[docker-base] ERROR: %s\n' "$*" >&2; exit 1; }

force=
[ "${1:-}" = "--force" ] && force=1

command -v docker >/dev/null || die "the docker client is missing: install Debian's docker.io"
docker info >/dev/null 2>&1 || die "no Docker daemon answers (start dockerd as root, or let tests/test_compose.py start it)"
if [ -z "$force" ] && [ "$(docker image inspect -f '{{index .Config.Labels "qmq.recipe"}}' "$IMAGE" 2>/dev/null)" = "$RECIPE" ]; then
    say "$IMAGE is up to date"
    exit 0
fi
[ "$(id -u)" = 0 ] || die "debootstrap needs root"
if ! command -v debootstrap >/dev/null; then
    say "installing debootstrap with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null \
        || die "debootstrap is missing and cannot be installed: apt-get install debootstrap"
fi

mirror=${QMQ_DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
    mirror=$(grep -rhoE '(URIs:|deb) +https?://[^ ]+/debian\b' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
        | awk '{print $2}' | head -n 1 || true)
    mirror=${mirror:-http://deb.debian.org/debian}
fi
security=${mirror%/debian}/debian-security

cleanup() {
    # debootstrap mounts /proc (and more) in the target while it runs: never delete through a mount.
    if [ -d "$ROOTFS" ]; then
        grep -o " $ROOTFS/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
        rm -rf --one-file-system "$ROOTFS"
    fi
}
trap cleanup EXIT
cleanup
mkdir -p "$WORK"

say "debootstrap $SUITE from $mirror into $ROOTFS"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
    || die "debootstrap failed (log: $WORK/debootstrap.log): $(tail -n 3 "$WORK/debootstrap.log")"

# The same sources as the official images (updates and security), and no package caches in the image.
cat >"$ROOTFS/etc/apt/sources.list" <<EOF
deb $mirror $SUITE main
deb $mirror $SUITE-updates main
deb $security $SUITE-security main
EOF
if [ -n "$(find "$LOCAL_CAS" -type f -name '*.crt' 2>/dev/null)" ]; then
    say "trusting this machine's local certificate authorities ($LOCAL_CAS)"
    cp -r "$LOCAL_CAS"/. "$ROOTFS$LOCAL_CAS"/
    chroot "$ROOTFS" update-ca-certificates >/dev/null 2>&1 || die "update-ca-certificates failed in the image"
fi
printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\nAcquire::Languages "none";\n' \
    >"$ROOTFS/etc/apt/apt.conf.d/90qmq-slim"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/*.log "$ROOTFS"/tmp/*

say "docker import $IMAGE"
tar -C "$ROOTFS" --numeric-owner -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change "LABEL qmq.recipe=\"$RECIPE\"" \
    --change 'CMD ["bash"]' \
    - "$IMAGE" >/dev/null
say "built $IMAGE"
