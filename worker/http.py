"""The worker's HTTP endpoint on `--metrics-port`: `/metrics` (Prometheus text format, the worker's
own registry) and `/healthz` (200 "ok" while live, 503 with the reason when not; worker/liveness.py),
what a Kubernetes liveness probe or a load balancer check expects. Served by a daemon thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def serve(
    host: str, port: int, registry: CollectorRegistry, health: Callable[[], tuple[bool, str]]
) -> ThreadingHTTPServer:
    """Start serving; the server's `server_port` is the port bound (0 picks a free one)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                healthy, reason = health()
                self._reply(200 if healthy else 503, (reason + "\n").encode(), "text/plain; charset=utf-8")
            elif path in ("/metrics", "/"):
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            else:
                self._reply(404, b"not found: try /metrics or /healthz\n", "text/plain; charset=utf-8")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: no log line each
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="qmq-worker-http", daemon=True).start()
    return server
