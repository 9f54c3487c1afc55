"""Serve the shipped models on a GPU and hold what the server says of its memory against the driver.

Starts the real server (one worker) with the shipped repository, where ``device = "auto"`` puts
both models on the first GPU; reads its memory plan and device-memory series from ``/metrics``
beside the driver's own view (``nvidia-smi``: the device's free memory and the process's own),
drives a steady concurrent load on digits and minilm from several client processes (so the
clients are not what binds), and reads both again. With ``--cpu`` CUDA is hidden, so a CPU line
can come from the same machine.

    python scripts/gpu_check.py --out DIR [--cpu] [--seconds 10] [--concurrency 64] [--clients 4]

Writes ``DIR/serve-<label>.json`` (after every step, so a run cut short still leaves what it
read) and the server's log ``DIR/server-<label>.log``; prints the load results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
DIGIT = [float(i % 17) for i in range(64)]
TEXT = "Batches sized to fit device memory, measured for the engine that runs them."
LOADS = {
    "digits": (
        "/v2/models/digits/infer",
        {"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": DIGIT}]},
    ),
    "minilm": ("/v1/embeddings", {"model": "minilm", "input": TEXT}),
}
SERIES = re.compile(
    r"^(nograd_(?:device_memory_\w+|batch_limit|model_\w+_bytes|model_memory_fit_error))"
    r"(\{[^}]*\})? (\S+)$"
)
"""The plan's and the device's series; histograms (``_bucket``) are left out."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def smi() -> dict[str, Any]:
    """The driver's view, in MiB: the device's total, used and free memory, and each process's."""

    def query(what: str) -> list[list[str]]:
        lines = subprocess.run(
            ["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.splitlines()
        return [[field.strip() for field in line.split(",")] for line in lines if line.strip()]

    try:
        ((total, used, free),) = query("gpu=memory.total,memory.used,memory.free")
        apps = query("compute-apps=pid,used_memory")
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        return {"error": str(error)}
    return {
        "total_mib": int(total),
        "used_mib": int(used),
        "free_mib": int(free),
        "processes_mib": {pid: int(mib) for pid, mib in apps},
    }


def read_metrics(client: httpx.Client) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in client.get("/metrics").text.splitlines():
        match = SERIES.match(line)
        if match:
            found[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return found


async def _drive(base: str, model: str, seconds: float, concurrency: int) -> list[Any]:
    path, body = LOADS[model]
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    stop = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as client:

        async def one() -> None:
            while time.perf_counter() < stop:
                start = time.perf_counter()
                answer = await client.post(path, json=body)
                latencies.append(time.perf_counter() - start)
                statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return [latencies, statuses]


def _client(args: tuple[str, str, float, int]) -> list[Any]:
    return asyncio.run(_drive(*args))


def load(base: str, model: str, seconds: float, concurrency: int, clients: int) -> dict[str, Any]:
    """``concurrency`` requests kept in flight, split over ``clients`` processes."""
    shares = [concurrency // clients + (i < concurrency % clients) for i in range(clients)]
    began = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(clients) as pool:
        results = pool.map(_client, [(base, model, seconds, share) for share in shares if share])
    took = time.perf_counter() - began
    latencies = sorted(x for found, _ in results for x in found)
    statuses: dict[str, int] = {}
    for _, counted in results:
        for status, count in counted.items():
            statuses[str(status)] = statuses.get(str(status), 0) + count

    def percentile(q: float) -> float:
        return round(1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))], 2)

    return {
        "requests": len(latencies),
        "per_s": round(len(latencies) / took, 1),
        "p50_ms": percentile(0.50),
        "p99_ms": percentile(0.99),
        "statuses": statuses,
    }


def mean_batch(client: httpx.Client, model: str) -> float | None:
    stats = client.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    batches = stats.get("batch_stats", [])
    count = sum(int(b["compute_infer"]["count"]) for b in batches)
    samples = sum(int(b["batch_size"]) * int(b["compute_infer"]["count"]) for b in batches)
    return round(samples / count, 2) if count else None


@contextmanager
def server(log: Path, cpu: bool, settings: dict[str, str]) -> Iterator[tuple[str, int]]:
    """The real server, one worker, in a process group of its own; yields its URL and pid."""
    port, grpc = free_port(), free_port()
    env = {
        **os.environ,
        "NOGRAD_PORT": str(port),
        "NOGRAD_GRPC_PORT": str(grpc),
        "NOGRAD_HOST": "127.0.0.1",
        "NOGRAD_WORKERS": "1",
        "NOGRAD_ENGINE_CACHE": tempfile.mkdtemp(prefix="nograd-engines-"),
        "NOGRAD_MODEL_REPOSITORY": str(ROOT / "models"),
        **settings,
    }
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    with log.open("w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "nograd"],
            cwd=ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield f"http://127.0.0.1:{port}", process.pid
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)


def wait_ready(client: httpx.Client, pid: int, limit_s: float) -> None:
    began = time.perf_counter()
    while time.perf_counter() - began < limit_s:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise RuntimeError("the server exited before it was ready") from None
        try:
            if client.get("/v2/health/ready").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not ready in {limit_s} s")


def check(args: argparse.Namespace) -> dict[str, Any]:
    settings = dict(item.split("=", 1) for item in args.set)
    report: dict[str, Any] = {"label": args.label, "settings": settings, "before_start": smi()}
    saved = args.out / f"serve-{args.label}.json"

    def save() -> None:
        saved.write_text(json.dumps(report, indent=1))

    began = time.perf_counter()
    try:
        with (
            server(args.out / f"server-{args.label}.log", args.cpu, settings) as (base, pid),
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            wait_ready(client, pid, args.ready_s)
            report["ready_s"] = round(time.perf_counter() - began, 1)
            report["at_ready"] = {"smi": smi(), "metrics": read_metrics(client)}
            save()
            for model in LOADS:
                report[model] = load(base, model, args.seconds, args.concurrency, args.clients)
                report[model]["mean_batch"] = mean_batch(client, model)
                save()
            report["after_load"] = {"smi": smi(), "metrics": read_metrics(client)}
    except Exception as error:  # the report says what broke, and the server log why
        report["error"] = repr(error)
    save()
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--label", default="gpu")
    parser.add_argument("--cpu", action="store_true", help="hide CUDA: the same run on CPU")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--clients", type=int, default=4, help="load generator processes")
    parser.add_argument("--ready-s", type=float, default=300.0)
    parser.add_argument("--set", nargs="*", default=[], help="NOGRAD_X=value settings")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = check(args)
    keys = ("label", "ready_s", "error", *LOADS)
    print(json.dumps({key: report.get(key) for key in keys}, indent=1))


if __name__ == "__main__":
    main()
