"""Triton's perf_analyzer, the standard load tool for Open Inference Protocol servers, run
unchanged against nograd over HTTP and over gRPC: it reads the model's metadata and
configuration, then drives inferences at a fixed concurrency and reports the server-side
statistics it reads back.

``scripts/fetch_perf_analyzer.sh`` fetches the binary and its libraries on a fresh machine; only
where that cannot work (no package index reachable) does the test skip, saying why.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.serving import ROOT, Server, metric_value

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
FETCH_SCRIPT = ROOT / "scripts" / "fetch_perf_analyzer.sh"
FAILURE_CODES = (400, 401, 404, 408, 413, 422, 429, 500, 503, 504, 507)


@functools.cache
def perf_analyzer() -> str:
    try:
        done = subprocess.run(
            ["bash", str(FETCH_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"{FETCH_SCRIPT.name} could not run: {exc}")
    path = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or not Path(path).is_file():
        pytest.skip(f"{FETCH_SCRIPT.name} failed (exit {done.returncode}): {done.stderr[-800:]}")
    return path


class Served:
    """One nograd serving HTTP and gRPC (on a free port) for every test in this module."""

    def __init__(self, server: Server, grpc_port: int) -> None:
        self.server = server
        self.url = server.url
        self.grpc_address = f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def served(server: Server) -> Served:
    assert server.grpc_address is not None
    return Served(server, int(server.grpc_address.rsplit(":", 1)[1]))


def _run(tool: str, model: str, protocol: str, address: str) -> subprocess.CompletedProcess[str]:
    """Three to six windows of 1 s at concurrency 4. These tests check the protocol, not a steady
    rate: on a shared 2-core machine one window's rate may be half the next one's, and a tighter
    stability percentage made perf_analyzer give up ("Failed to obtain stable measurement") while
    other tests ran beside it, so any three windows in a row end the run."""
    return subprocess.run(
        [
            tool,
            "-m", model,
            "-u", address,
            "-i", protocol,
            "--concurrency-range", "4",
            "--measurement-interval", "1000",
            "--max-trials", "6",
            "--stability-percentage", "1000",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip


def _server_side_successes(report: str) -> int:
    """perf_analyzer read the server's own statistics back: every request it counted succeeded."""
    server_side = re.search(
        r"Server:\s+Inference count: (\d+).*?Successful request count: (\d+)", report, re.S
    )
    assert server_side is not None, report
    assert int(server_side[1]) == int(server_side[2]) > 0, report
    return int(server_side[2])


def _failed(url: str, model: str, **labels: str) -> float:
    return sum(
        metric_value(url, "nograd_requests_total", model=model, code=str(code), **labels)
        for code in FAILURE_CODES
    )


@pytest.mark.parametrize(("model", "at_least_per_s"), [("digits", 20), ("minilm", 1)])
def test_perf_analyzer_drives_each_model_over_http(
    served: Served, model: str, at_least_per_s: float
) -> None:
    """On minilm it sends random texts shaped [1, 1], as the metadata and configuration say. The
    rates only show it ran: this checks the protocol, and a machine busy with other work (a
    CPU-heavy process beside the suite) serves minilm a few texts a second."""
    tool = perf_analyzer()
    url = served.url
    host = url.removeprefix("http://")
    before = metric_value(url, "nograd_requests_total", model=model, code="200")
    failed_before = _failed(url, model)
    done = _run(tool, model, "http", host)
    report = done.stdout
    assert done.returncode == 0, report + done.stderr
    throughput = re.search(r"Throughput: ([\d.]+) infer/sec", report)
    assert throughput is not None and float(throughput[1]) > at_least_per_s, report
    successes = _server_side_successes(report)
    answered = metric_value(url, "nograd_requests_total", model=model, code="200") - before
    assert answered >= successes
    assert _failed(url, model) == failed_before  # the server is shared: its earlier failures


def test_perf_analyzer_drives_digits_over_grpc(served: Served) -> None:
    """perf_analyzer's gRPC client (``-i grpc``) reads metadata, configuration and statistics
    over gRPC and sends raw tensors; nograd counts each call under ``protocol="grpc"``."""
    tool = perf_analyzer()
    url = served.url
    before_grpc = metric_value(url, "nograd_requests_total", model="digits", protocol="grpc")
    before_ok = metric_value(
        url, "nograd_requests_total", model="digits", protocol="grpc", code="200"
    )
    before_http = metric_value(url, "nograd_requests_total", model="digits", protocol="http")
    failed_before = _failed(url, "digits", protocol="grpc")
    done = _run(tool, "digits", "grpc", served.grpc_address)
    report = done.stdout
    assert done.returncode == 0, report + done.stderr
    throughput = re.search(r"Throughput: ([\d.]+) infer/sec", report)
    assert throughput is not None and float(throughput[1]) > 10, report
    successes = _server_side_successes(report)
    answered = metric_value(url, "nograd_requests_total", model="digits", protocol="grpc")
    ok = metric_value(url, "nograd_requests_total", model="digits", protocol="grpc", code="200")
    # Every gRPC call was answered 200 (OK), at least as many as perf_analyzer measured, and
    # none of them went over HTTP.
    assert ok - before_ok == answered - before_grpc >= successes
    assert _failed(url, "digits", protocol="grpc") == failed_before
    assert metric_value(url, "nograd_requests_total", model="digits", protocol="http") == (
        before_http
    )
