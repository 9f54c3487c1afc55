"""The command composes the layers: the workers' serving function is named, not imported."""

from __future__ import annotations

from nograd import server
from nograd.cli import SERVE_WORKER
from nograd.supervisor.worker import load_serve


def test_the_named_serving_function_is_the_servers() -> None:
    assert load_serve(SERVE_WORKER) is server.serve_worker
