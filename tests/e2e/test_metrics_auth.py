"""``NOGRAD_AUTH_METRICS`` guards every place the metrics are served: ``/metrics`` on the HTTP
port and the separate metrics port, in one process and with workers (where the supervisor serves
the metrics port)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.serving import digits_repository, free_port, run_server

pytestmark = pytest.mark.e2e
KEY = "k-metrics-0123456789"


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_metrics_port_asks_for_a_key_when_metrics_are_guarded(tmp_path: Path, workers: int) -> None:
    metrics_port = free_port()
    env = {
        "NOGRAD_WORKERS": str(workers),
        "NOGRAD_MODEL_REPOSITORY": str(digits_repository(tmp_path)),
        "NOGRAD_METRICS_PORT": str(metrics_port),
        "NOGRAD_API_KEYS": f"other-key,{KEY}",
        "NOGRAD_AUTH_METRICS": "true",
    }
    with run_server(tmp_path, env) as server:
        for url in (f"{server.url}/metrics", f"http://127.0.0.1:{metrics_port}/metrics"):
            missing = httpx.get(url, timeout=10)
            assert missing.status_code == 401, url
            assert missing.headers["www-authenticate"].startswith("Bearer")
            assert "missing API key" in missing.json()["error"]
            assert "nograd_" not in missing.text
            wrong = httpx.get(url, headers={"Authorization": "Bearer not-a-key"}, timeout=10)
            assert wrong.status_code == 401, url
            assert "invalid API key" in wrong.json()["error"]
            scraped = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
            assert scraped.status_code == 200, url
            assert "nograd_model_ready" in scraped.text
        assert KEY not in server.log()


def test_metrics_port_stays_open_without_auth_metrics(tmp_path: Path) -> None:
    """Keys on inference only: scrapers keep reading the metrics port without one, as /metrics."""
    metrics_port = free_port()
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(digits_repository(tmp_path)),
        "NOGRAD_METRICS_PORT": str(metrics_port),
        "NOGRAD_API_KEYS": KEY,
    }
    with run_server(tmp_path, env) as server:
        for url in (f"{server.url}/metrics", f"http://127.0.0.1:{metrics_port}/metrics"):
            scraped = httpx.get(url, timeout=10)
            assert scraped.status_code == 200, url
            assert "nograd_model_ready" in scraped.text
