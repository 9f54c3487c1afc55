"""The HTTP front of a server process: the app over the serving core under the HTTP listener.

``nograd.server`` decides when it starts, drains and stops; this front says whether it still
holds a request, so the drain keeps the port open until none is left.
"""

from __future__ import annotations

import ctypes

from nograd.http.app import build_app
from nograd.http.listener import HttpListener
from nograd.observability.metrics import UNKNOWN_MODEL
from nograd.serving.core import Core


class HttpFront(HttpListener):
    def __init__(self, core: Core, closed: ctypes.c_longlong | None = None) -> None:
        """``closed``: a count of closed connections to keep (a worker's, for its supervisor)."""
        metrics = core.metrics

        def count_refusal(reason: str) -> None:
            metrics.rejected.labels(UNKNOWN_MODEL, reason).inc()

        super().__init__(build_app(core), core.settings, count_refusal, closed)
