#!/usr/bin/env bash
# Certificates for docker-compose.tls.yml: a CA and one server certificate it signs, naming every
# qmq service of docker-compose.yml (the addresses containers dial), localhost and 127.0.0.1 (the
# addresses the host dials). Development certificates: the private key is readable by all, for the
# containers; use your own PKI beyond a laptop (docs/security.md).
#
#   bash scripts/compose-tls-certs.sh [DIR]     # default: ./tls beside docker-compose.yml
set -euo pipefail

DIR="${1:-$(cd "$(dirname "$0")/.." && pwd)/tls}"
DAYS="${QMQ_TLS_DAYS:-365}"
NAMES="DNS:meta,DNS:broker-a,DNS:broker-a-replica,DNS:broker-b,DNS:broker-b-replica,DNS:delay,DNS:delay-replica,DNS:localhost,IP:127.0.0.1"

command -v openssl >/dev/null || { echo "openssl is missing (Debian: apt-get install openssl)" >&2; exit 1; }
mkdir -p "$DIR"
cd "$DIR"
openssl req -x509 -newkey rsa:2048 -nodes -days "$DAYS" -subj "/CN=qmq compose CA" \
    -keyout ca.key -out ca.pem 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=qmq compose" -keyout server.key -out server.csr 2>/dev/null
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$NAMES" > server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days "$DAYS" \
    -extfile server.ext -out server.pem 2>/dev/null
rm -f server.csr server.ext ca.srl ca.key   # nothing more is signed with this CA
chmod 644 ca.pem server.pem server.key
echo "made $DIR/ca.pem (clients: QMQ_TLS_CA), $DIR/server.pem and server.key (every server)"
