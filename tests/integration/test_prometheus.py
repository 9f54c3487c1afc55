"""A real Prometheus scrapes a real nograd under load; what it computes matches what clients saw.

One nograd (the digits model only, so it starts in seconds) and one Prometheus (Debian's package,
installed by scripts/install_debian_package.sh when missing) run on loopback for the whole module.
Prometheus scrapes every second and loads the alert rules. Then:

- wrk (Debian's package, installed the same way) posts digits samples on 8 paced connections for
  8 s; the p99 that ``histogram_quantile`` computes from ``nograd_request_duration_seconds`` over
  exactly that window lies in the bucket holding the p99 wrk measured, or the one below it (the
  server's clock starts after the HTTP request is parsed and stops before the response is
  written, so it can only read less). A p99 is a tail and this machine is shared: a window that
  misses is followed by one fresh window, which decides;
- ``promtool check metrics`` finds nothing to complain about in ``/metrics``;
- the alert rules load and evaluate against real series, and every dashboard query runs;
- the server's log is one JSON object per line, uvicorn's lines and the startup summary included.
"""

from __future__ import annotations

import bisect
import json
import math
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.loadgen import run_closed
from nograd.observability.metrics import DURATION_BUCKETS
from tests.e2e.serving import ROOT, Server, free_port, metric_value, run_server
from tests.prometheus_tools import (
    GRAFANA_DIR,
    alerting_rules,
    prometheus,
    promtool,
    rule_files,
    wrk,
)

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

INFER = "/v2/models/digits/infer"
BODY = (ROOT / "models" / "digits" / "sample.json").read_bytes()
LOAD_SECONDS = 8.0
CONCURRENCY = 8
PAUSE_MS = 20.0
"""Each connection's wait after every answer: ~300 requests/s in all, load that forms batches
and stays below what two cores serve."""
QUERY = 'model="digits", protocol="v2"'


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    client: httpx.Client

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, str | float] = {"query": expr}
        if at is not None:
            params["time"] = at
        response = self.client.get("/api/v1/query", params=params)
        document: dict[str, Any] = response.json()
        assert document["status"] == "success", f"{expr}: {document}"
        result: list[dict[str, Any]] = document["data"]["result"]
        return result

    def scalar(self, expr: str, at: float | None = None) -> float:
        result = self.query(expr, at)
        assert len(result) == 1, f"{expr}: expected one series, got {result}"
        return float(result[0]["value"][1])


@dataclass
class Load:
    requests: int
    """Answers wrk counted; the server may have answered up to CONCURRENCY more, cut off by
    wrk's deadline, which Prometheus counts too."""
    p99_s: float
    started: float
    ended: float


@dataclass
class Measurement:
    load: Load
    promql_p99: float
    rate_p99: float
    window: int


@pytest.fixture(scope="module")
def nograd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Only digits: the other shipped models take tens of seconds to load and profile.
    repository = tmp_path_factory.mktemp("models")
    shutil.copytree(ROOT / "models" / "digits", repository / "digits")
    env = {"NOGRAD_MODEL_REPOSITORY": str(repository), "NOGRAD_LOG_FORMAT": "json"}
    with run_server(tmp_path_factory.mktemp("nograd-log"), env=env) as server:
        yield server


@pytest.fixture(scope="module")
def prom(nograd: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    binary = prometheus()
    workdir = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(path) for path in rule_files()],
        "scrape_configs": [
            {
                "job_name": "nograd",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [nograd.url.removeprefix("http://")]}],
            }
        ],
    }
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = workdir / "prometheus.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    url = f"http://127.0.0.1:{port}"
    server = Prometheus(url, process, log_path, httpx.Client(base_url=url, timeout=10))
    try:
        _wait_ready(server)
        yield server
    finally:
        server.client.close()
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(server: Prometheus, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"prometheus exited:\n{server.log_path.read_text(errors='replace')}")
        try:
            if httpx.get(f"{server.url}/-/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"prometheus not ready:\n{server.log_path.read_text(errors='replace')}")


def _wait_for(check: Any, what: str, timeout_s: float = 15.0, interval_s: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"timed out waiting for {what} (last: {last!r})")


def _generate_load(url: str, bodies: Path) -> Load:
    """wrk on CONCURRENCY keep-alive connections, each pausing PAUSE_MS after every answer.

    wrk, not Python clients: on two cores, eight httpx client threads took the CPU the server
    needed and their own GIL waits into their clocks, which put their p99 1.25-1.7x above the
    server's (up to two buckets) while wrk, a C event loop, read 1.0-1.3x. The
    pause keeps the load below saturation, so the test measures nograd's histogram and not the
    machine running out of cores; a server slower than the pace gets requests back to back.
    """
    wrk()  # installs Debian's wrk when missing, or skips saying why
    started = time.time()
    result = run_closed(
        url + INFER,
        bodies,
        system="nograd",
        workload="digits",
        samples_per_request=1,
        connections=CONCURRENCY,
        duration_s=LOAD_SECONDS,
        cpus=None,
        pause_ms=PAUSE_MS,
    )
    ended = time.time()
    assert result.errors == 0, result.errors_detail
    # The pause took effect: no connection sent more than one request per pause.
    assert result.requests <= CONCURRENCY * LOAD_SECONDS * 1000 / PAUSE_MS, result.requests
    return Load(result.requests, result.p99_ms / 1000, started, ended)


def _served_count(url: str) -> float:
    return metric_value(url, "nograd_request_duration_seconds_count", model="digits", protocol="v2")


def _scraped_count(prom: Prometheus) -> float:
    return prom.scalar(f"sum(nograd_request_duration_seconds_count{{{QUERY}}})")


def _measure(nograd: Server, prom: Prometheus, bodies: Path) -> Measurement:
    """One load window, and the p99 Prometheus computes over exactly that window's requests."""
    before = _scraped_count(prom)
    # Prometheus already holds `before` and no request runs until the load starts, so the
    # sample it finds at `since` is the count before the window.
    since = time.time()
    load = _generate_load(nograd.url, bodies)
    # Requests wrk's deadline cut off finish within milliseconds; then the count stands still.
    total = _wait_for(lambda: _settled(nograd.url), "the server to finish the window's requests")
    assert load.requests <= total - before <= load.requests + CONCURRENCY, (before, total, load)
    _wait_for(lambda: _scraped_count(prom) == total, f"Prometheus to scrape all {total} requests")
    buckets = f"nograd_request_duration_seconds_bucket{{{QUERY}}}"
    # The window's requests only: buckets now minus buckets at `since` (the @ modifier), no
    # rate() extrapolation. The same population the client timed.
    promql_p99 = prom.scalar(
        f"histogram_quantile(0.99, sum by (le) ({buckets}) - sum by (le) ({buckets} @ {since}))"
    )
    # The dashboard's form, rate over the last seconds of the window: reported, not asserted.
    window = max(2, math.floor(load.ended - load.started) - 1)
    rate_p99 = prom.scalar(
        f"histogram_quantile(0.99, sum by (le) (rate({buckets}[{window}s])))", at=load.ended
    )
    return Measurement(load, promql_p99, rate_p99, window)


def _settled(url: str) -> float | None:
    """The server's request count once it has stopped moving for 0.3 s, else None."""
    first = _served_count(url)
    time.sleep(0.3)
    return first if _served_count(url) == first else None


@pytest.fixture(scope="module")
def bodies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits sample as wrk's body file: one JSON body per line."""
    path = tmp_path_factory.mktemp("wrk") / "bodies.jsonl"
    path.write_text(json.dumps(json.loads(BODY)) + "\n")
    return path


@pytest.fixture(scope="module")
def measured(nograd: Server, prom: Prometheus, bodies: Path) -> Measurement:
    # The series appear on the first request; let Prometheus see them before the load starts.
    assert httpx.post(nograd.url + INFER, content=BODY, timeout=10).status_code == 200
    _wait_for(lambda: prom.query(f"nograd_request_duration_seconds_count{{{QUERY}}}"), "a scrape")
    return _measure(nograd, prom, bodies)


@pytest.fixture(scope="module")
def load(measured: Measurement) -> Load:
    return measured.load


def _bucket_index(value: float) -> int:
    """Index of the histogram bucket (upper bound inclusive, as Prometheus' le) holding value."""
    return bisect.bisect_left(DURATION_BUCKETS, value)


def _agreement(measurement: Measurement) -> tuple[bool, str]:
    requests = measurement.load.requests
    assert requests >= 200, f"too few requests for a p99: {requests}"
    client_p99 = measurement.load.p99_s
    index = _bucket_index(client_p99)
    assert index < len(DURATION_BUCKETS), f"client p99 {client_p99:.4f}s beyond the last bucket"
    # The server's clock starts once the request is parsed and stops before the response is
    # written, so it reads less than the client: HTTP parsing and writing, and under load the
    # wait to be read. At most the client's bucket, and at least half the client's p99 to the
    # buckets' resolution (a bound on the client's value, not on its bucket: a client p99 just
    # above a bucket edge must not narrow the range).
    upper = DURATION_BUCKETS[index]
    half = _bucket_index(client_p99 / 2)
    lower = DURATION_BUCKETS[half - 1] if half >= 1 else 0.0
    seconds = measurement.load.ended - measurement.load.started
    report = (
        f"{requests} requests in {seconds:.1f}s; client p99 {client_p99 * 1000:.2f} ms "
        f"(bucket ≤{upper * 1000:.2f} ms); PromQL p99 {measurement.promql_p99 * 1000:.2f} ms; "
        f"rate[{measurement.window}s] p99 {measurement.rate_p99 * 1000:.2f} ms; "
        f"allowed ({lower * 1000:.2f}, {upper * 1000:.2f}] ms"
    )
    return lower < measurement.promql_p99 <= upper, report


def test_promql_p99_agrees_with_client_p99(
    nograd: Server, prom: Prometheus, bodies: Path, measured: Measurement
) -> None:
    ok, report = _agreement(measured)
    print(report)  # shown with -s: the numbers behind the assertion
    if not ok:
        # A p99 is the tail, and on a shared two-core machine another process can own the tail
        # of one 8-second window. A wrong histogram (units, buckets, what it times) fails every
        # window; noise does not repeat. One fresh window decides.
        ok, second = _agreement(_measure(nograd, prom, bodies))
        print(second)
        report = f"first window: {report}\nsecond window: {second}"
    assert ok, report


def test_promtool_check_metrics_passes(nograd: Server, load: Load) -> None:
    del load  # after the load, every labelled series has children to lint
    # A 404 and a 400 add their label values too.
    httpx.post(nograd.url + "/v2/models/nope/infer", content=BODY, timeout=10)
    httpx.post(nograd.url + INFER, content=b'{"inputs": []}', timeout=10)
    text = httpx.get(nograd.url + "/metrics", timeout=10).text
    done = subprocess.run(
        [promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    complaints = (done.stdout + done.stderr).strip()
    assert done.returncode == 0 and not complaints, f"promtool check metrics:\n{complaints}"


def test_alert_rules_evaluate_on_real_series(prom: Prometheus, load: Load) -> None:
    del load
    expected = {rule["alert"] for rule in alerting_rules()}

    def evaluated() -> list[dict[str, Any]] | None:
        response = prom.client.get("/api/v1/rules", params={"type": "alert"})
        groups: list[dict[str, Any]] = response.json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        done = {rule["name"] for rule in rules if rule.get("lastEvaluation", "").startswith("2")}
        return rules if done >= expected and len(rules) == len(expected) else None

    rules = _wait_for(evaluated, "every alert rule to be evaluated")
    broken = {rule["name"]: rule.get("lastError") for rule in rules if rule["health"] != "ok"}
    assert not broken, broken
    # A healthy server under a short load: nothing that pages should fire.
    firing = {rule["name"] for rule in rules if rule["state"] == "firing"}
    assert not firing, firing


def test_dashboard_queries_run_and_show_data(prom: Prometheus, load: Load) -> None:
    """Every panel's query evaluates (vector matching errors only show here) against real series."""
    del load
    dashboard = json.loads((GRAFANA_DIR / "dashboards" / "nograd.json").read_text())
    substitutions = {"$__rate_interval": "5s", "$model": ".*", "$instance": ".*"}
    empty: list[str] = []
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in substitutions.items():
                expr = expr.replace(variable, value)
            if not prom.query(expr):
                empty.append(f"{panel['title']} {target['refId']}")
    # Panels that must show data for a server that just served traffic. OOMs, rejections,
    # drops and restarts are rightly empty here; so are alerts.
    must_have_data = {
        "Throughput A",
        "Throughput by model A",
        "Request latency p50 / p95 / p99 by model C",
        "Queue depth and in-flight requests A",
        "Batch size distribution A",
        "Batch size and batch limit C",
        "Device memory vs budget A",
        "Device memory vs budget E",
        "Model ready A",
    }
    assert not must_have_data & set(empty), sorted(must_have_data & set(empty))


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def test_server_logs_are_json_lines(nograd: Server) -> None:
    # A request uvicorn's parser refuses makes uvicorn log a line of its own.
    host, port = nograd.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as garbage:
        garbage.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        garbage.recv(1024)
    deadline = time.monotonic() + 5
    while "uvicorn.error" not in nograd.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [line for line in nograd.log().splitlines() if line.strip()]
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"not a JSON log line: {line!r}")
    assert all({"timestamp", "level", "logger", "message"} <= record.keys() for record in records)
    loggers = {record["logger"] for record in records}
    assert "uvicorn.error" in loggers, loggers  # uvicorn's own lines, same format
    messages = "\n".join(record["message"] for record in records)
    assert "model digits v1 loaded on cpu" in messages
    # The start-up summary: one record per model, its columns as fields.
    (summary,) = [r for r in records if r["logger"] == "nograd.serving.control.ready_summary"]
    assert (summary["model"], summary["device"], summary["state"]) == ("digits", "cpu", "ready")
    assert summary["limit"] > 0 and summary["weights_bytes"] > 0 and summary["batch_bytes"] > 0
