"""Triton's perf_analyzer, the standard load tool for Open Inference Protocol servers, run
unchanged against nograd: it reads the model's metadata and configuration, then drives
inferences at a fixed concurrency and reports the server-side statistics it reads back.

``scripts/fetch_perf_analyzer.sh`` fetches the binary and its libraries on a fresh machine; only
where that cannot work (no package index reachable) does the test skip, saying why.
"""

from __future__ import annotations

import functools
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.serving import ROOT, Server, metric_value, run_server

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
FETCH_SCRIPT = ROOT / "scripts" / "fetch_perf_analyzer.sh"


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


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(tmp_path_factory.mktemp("perf_analyzer")) as server:
        yield server


@pytest.mark.parametrize(("model", "at_least_per_s"), [("digits", 50), ("minilm", 5)])
def test_perf_analyzer_drives_each_model_over_http(
    server: Server, model: str, at_least_per_s: float
) -> None:
    """On minilm it sends random texts shaped [1, 1], as the metadata and configuration say."""
    tool = perf_analyzer()
    host = server.url.removeprefix("http://")
    before = metric_value(server.url, "nograd_requests_total", model=model, code="200")
    done = subprocess.run(
        [
            tool,
            "-m", model,
            "-u", host,
            "-i", "http",
            "--concurrency-range", "4",
            "--measurement-interval", "1000",
            "--max-trials", "6",
            "--stability-percentage", "50",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    report = done.stdout
    assert done.returncode == 0, report + done.stderr
    throughput = re.search(r"Throughput: ([\d.]+) infer/sec", report)
    assert throughput is not None and float(throughput[1]) > at_least_per_s, report
    # perf_analyzer read the server's own statistics back: every request succeeded.
    server_side = re.search(
        r"Server:\s+Inference count: (\d+).*?Successful request count: (\d+)", report, re.S
    )
    assert server_side is not None, report
    assert int(server_side[1]) == int(server_side[2]) > 0
    served = metric_value(server.url, "nograd_requests_total", model=model, code="200") - before
    assert served >= int(server_side[2])
    failed = sum(
        metric_value(server.url, "nograd_requests_total", model=model, code=str(code))
        for code in (400, 404, 422, 500, 503, 504)
    )
    assert failed == 0
