"""Start a real nograd server (``python -m nograd`` under uvicorn) on a free port, for e2e tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from nograd.supervisor.stopping import REPEAT_WINDOW_S

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    grpc_address: str | None = None
    """``127.0.0.1:PORT`` when the server serves gRPC."""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def records(self) -> list[dict[str, Any]]:
        """The log's JSON records (its format when not on a terminal), one per line; a table's
        rows are records of their own (``nograd.observability.log_tables``)."""
        found = []
        for line in self.log().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if isinstance(record, dict):
                    found.append(record)
        return found

    def ready_summary(self) -> dict[str, dict[str, Any]]:
        """The start-up summary's rows by model name (``nograd.serving.control.ready_summary``)."""
        return {
            record["model"]: record
            for record in self.records()
            if record["logger"] == "nograd.serving.control.ready_summary" and "model" in record
        }


def digits_repository(root: Path) -> Path:
    """A repository of the shipped digits model alone under ``root``: the fastest real model to
    start."""
    repo = root / "repo"
    shutil.copytree(ROOT / "models" / "digits", repo / "digits")
    return repo


@contextmanager
def run_server(
    log_dir: Path,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 120.0,
    wait_ready: bool = True,
    command: Sequence[str] | None = None,
) -> Iterator[Server]:
    """A server in a process group of its own (so a test may signal the whole group), started by
    ``command`` (default ``python -m nograd``)."""
    port = free_port()
    log_path = log_dir / f"nograd-{port}.log"
    full_env = {
        **os.environ,
        "NOGRAD_HOST": "127.0.0.1",
        "NOGRAD_PORT": str(port),
        "NOGRAD_MODEL_REPOSITORY": str(ROOT / "models"),
        "NOGRAD_LOG_LEVEL": "info",
        # One process unless a test asks for more: the auto plan has tests of its own, and
        # two workers per server would double every start-up in the suite.
        "NOGRAD_WORKERS": "1",
        **(env or {}),
    }
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command or [sys.executable, "-m", "nograd"],
            cwd=ROOT,
            env=full_env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    grpc_port = int(full_env.get("NOGRAD_GRPC_PORT") or 0)
    grpc_address = f"127.0.0.1:{grpc_port}" if grpc_port else None
    server = Server(f"http://127.0.0.1:{port}", process, log_path, grpc_address)
    try:
        if wait_ready:
            wait_until_ready(server, ready_timeout_s)
        yield server
    finally:
        stop_server(server)


def wait_until_ready(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server not ready after {timeout_s}s:\n{server.log()}")


def stop_server(server: Server, timeout_s: float = 30.0) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return server.process.returncode


def worker_pids(server: Server) -> dict[int, int]:
    """Worker index -> pid of its latest start, from the supervisor's log."""
    started = re.findall(r"worker (\d+) started \(pid (\d+)\)", server.log())
    return {int(index): int(pid) for index, pid in started}


def wait_for_log(server: Server, text: str, times: int = 1, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.log().count(text) < times:
        assert server.process.poll() is None, server.log()
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{server.log()}"
        time.sleep(0.1)


def metric_value(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` on ``url``/metrics whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_until_accepted(url: str, count: int, model: str, timeout_s: float = 60.0) -> None:
    """Wait until the server holds or has answered ``count`` requests for ``model`` (every
    worker's, from one scrape), so a test signals a server that really holds its work rather
    than one whose event loop, on a loaded machine, has not read the requests yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = metric_value(url, "nograd_inflight_requests")
        answered = metric_value(url, "nograd_requests_total", model=model)
        if held + answered >= count:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{held + answered:.0f} of {count} requests reached the server")
        time.sleep(0.02)


async def until_accepted(url: str, count: int, model: str = "slow") -> None:
    """``wait_until_accepted`` from a test's event loop, without blocking the loop's clients."""
    await asyncio.to_thread(wait_until_accepted, url, count, model)


SLOW_BODY = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}
"""One row for the ``slow`` fixture model (100 ms per batch of at most 2 rows)."""


def stop_then_interrupt_under_load(server: Server, requests: int) -> float:
    """Send ``requests`` to the slow model at once, SIGTERM once the server holds them all and a
    copy of it at once (as make passes it on), check that a connection opened during the drain
    gets 503, then Ctrl+C once the stop was acknowledged; the seconds from the first SIGTERM
    until the server exited."""
    stopped_at = 0.0

    async def wave() -> None:
        nonlocal stopped_at
        limits = httpx.Limits(max_connections=requests)
        async with httpx.AsyncClient(base_url=server.url, timeout=90, limits=limits) as client:
            calls = [client.post("/v2/models/slow/infer", json=SLOW_BODY) for _ in range(requests)]
            tasks = [asyncio.ensure_future(call) for call in calls]
            await until_accepted(server.url, requests)
            stopped_at = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.02)
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            # A connection opened during the drain is still served, with a clear 503.
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as fresh:
                late = await fresh.post("/v2/models/slow/infer", json=SLOW_BODY)
            assert late.status_code == 503, late.text
            await asyncio.sleep(REPEAT_WINDOW_S)
            server.process.send_signal(signal.SIGINT)
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(wave())
    assert server.process.wait(30) == 0, server.log()
    return time.monotonic() - stopped_at
