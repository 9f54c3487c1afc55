"""Phase ``residency``: many ONNX models under one memory limit, loaded on demand.

It measures what on-demand serving costs a client: each model's first request (a cold load) against
its second (resident), then requests/s from a few clients over a working set that fits the limit
against one that does not (every request may then wait for a load and an eviction).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from typing import Any

import orjson

from bench.common import RESULTS, http_post, nograd_server, percentile, scrape_metrics
from bench.residency_models import ROWS, onnx_repository
from bench.session import Bench

CLIENTS = 4


def _infer(url: str, model: str) -> tuple[float, bool]:
    """Seconds for one request to ``model`` and whether it answered its own index."""
    body = orjson.dumps(
        {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, ROWS], "data": [0.0] * ROWS}]}
    )
    started = time.perf_counter()
    status, answer = http_post(f"{url}/v2/models/{model}/infer", body, timeout=120.0)
    seconds = time.perf_counter() - started
    if status != 200:
        return seconds, False
    value = orjson.loads(answer)["outputs"][0]["data"][0]
    return seconds, round(float(value)) == int(model.removeprefix("m"))


def _closed_loop(url: str, models: list[str], seconds: float) -> dict[str, Any]:
    """``CLIENTS`` clients, each asking a model drawn uniformly from ``models`` in turn."""
    latencies: list[float] = []
    wrong = 0
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(seed: int) -> None:
        nonlocal wrong
        rng = random.Random(seed)
        while time.monotonic() < stop:
            took, right = _infer(url, rng.choice(models))
            with lock:
                latencies.append(took)
                wrong += not right

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(CLIENTS)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    return {
        "models": len(models),
        "requests": len(latencies),
        "wrong": wrong,
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
        "p99_ms": 1000 * percentile(latencies, 0.99) if latencies else None,
    }


def _loads(url: str) -> float:
    return sum(
        value
        for (name, _), value in scrape_metrics(url).items()
        if name == "nograd_model_loads_total"
    )


def phase_residency(bench: Bench) -> None:
    quick = bench.plan.quick
    count, weights_mib = (8, 8) if quick else (24, 32)
    fits = 3 if quick else 6
    limit_mib = (fits + 1) * weights_mib * 2
    seconds = 6.0 if quick else 20.0
    record: dict[str, Any] = {
        "models": count,
        "weights_mib": weights_mib,
        "limit_mib": limit_mib,
        "clients": CLIENTS,
        "seconds": seconds,
    }
    bench.results["residency"] = record
    folder = RESULTS / f"{bench.stamp}-residency"
    bench.step("residency: build the models")
    repository = onnx_repository(folder, count, weights_mib)
    env = {"NOGRAD_MODEL_CONTROL": "on_demand", "NOGRAD_MEMORY_LIMIT_BYTES": f"{limit_mib}MiB"}
    with nograd_server(repository, bench.plan.server_cpus, env) as server:
        bench.step("residency: cold and resident requests")
        names = [f"m{index}" for index in range(count)]
        cold: list[float] = []
        warm: list[float] = []
        wrong = 0
        for name in names:
            for kind in (cold, warm):
                took, right = _infer(server.url, name)
                kind.append(took)
                wrong += not right
        record["cold_ms"] = [round(1000 * s, 1) for s in cold]
        record["resident_ms"] = [round(1000 * s, 1) for s in warm]
        record["wrong"] = wrong
        bench.step("residency: a working set that fits")
        before = _loads(server.url)
        record["fits"] = _closed_loop(server.url, names[:fits], seconds)
        record["fits"]["loads"] = _loads(server.url) - before
        bench.step("residency: a working set that does not")
        before = _loads(server.url)
        record["exceeds"] = _closed_loop(server.url, names, seconds)
        record["exceeds"]["loads"] = _loads(server.url) - before
    bench.note(
        f"residency: cold p50 {statistics.median(record['cold_ms']):.0f} ms, resident p50 "
        f"{statistics.median(record['resident_ms']):.1f} ms; fits {record['fits']['rps']:.0f} "
        f"req/s, exceeds {record['exceeds']['rps']:.0f} req/s"
    )
