"""The connector's counters in Prometheus' text format, on a port of the vLLM worker.

vLLM's own metrics cover its scheduler (`vllm:external_prefix_cache_hits_total`); these
say what the pool did: blocks and bytes saved, loaded, dropped, failed loads, and the
seconds spent loading and copying saves out (on the forward path), sending saves (in
the background) and in the scheduler's step.
"""

from __future__ import annotations

import threading
from dataclasses import fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from quillcache_vllm.pool import PoolCounters

PREFIX = "quillcache_connector_"


def render(counters: PoolCounters) -> str:
    lines = []
    for f in fields(counters):
        name = PREFIX + f.name + ("" if f.name.endswith("seconds") else "_total")
        lines.append(f"# TYPE {name} counter")
        lines.append(f"{name} {getattr(counters, f.name)}")
    return "\n".join(lines) + "\n"


def serve(counters: PoolCounters, host: str, port: int, tls=None) -> ThreadingHTTPServer:
    """Serve GET /metrics in a daemon thread; returns the server (its port is bound).
    With `tls` (a `Tls`), HTTPS that demands a certificate of the cluster's CA."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = render(counters).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            return

    server = ThreadingHTTPServer((host, port), Handler)
    if tls is not None:
        # The handshake runs in the connection's own thread, on its first read.
        server.socket = tls.server_context().wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
    threading.Thread(target=server.serve_forever, name="quillcache-metrics", daemon=True).start()
    return server
