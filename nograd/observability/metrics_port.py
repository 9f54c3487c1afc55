"""The separate metrics port (``NOGRAD_METRICS_PORT``): Prometheus' exposition on its own port,
behind the same API keys as ``/metrics`` when ``NOGRAD_AUTH_METRICS`` asks for them.

prometheus_client's own ``start_http_server`` cannot check a key, so a server with keys and
``NOGRAD_AUTH_METRICS`` would still show every model's name and traffic on that port.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from nograd.protocol.keys import bearer_key_matches

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
KEY_HINT = "send one 'Authorization: Bearer <key>' header"


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    """A scrape in progress never holds the process up at exit."""


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged: one line per scrape would drown the server's log."""


def keyed(app: WsgiApp, keys: Sequence[bytes]) -> WsgiApp:
    """``app`` answering only calls that carry one of ``keys``; others get 401, as ``/metrics``
    on the HTTP port answers them."""

    def guarded(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION")
        values = [] if given is None else [given]
        if bearer_key_matches(values, keys):
            return app(environ, start_response)
        why = "missing" if given is None else "invalid"
        body = json.dumps({"error": f"{why} API key: {KEY_HINT}"}).encode()
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                ("WWW-Authenticate", 'Bearer realm="nograd"'),
            ],
        )
        return [body]

    return guarded


def serve_metrics_port(
    host: str, port: int, registry: CollectorRegistry, keys: Sequence[str] = ()
) -> None:
    """Serve ``registry`` on ``host:port`` from a daemon thread; with ``keys``, only to calls
    that carry one."""
    app: WsgiApp = make_wsgi_app(registry)
    if keys:
        app = keyed(app, tuple(key.encode() for key in keys))
    server_class = _Server6 if ":" in host else _Server
    server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-port", daemon=True).start()
