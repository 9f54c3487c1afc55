"""Phase ``residency``: many ONNX models under one memory limit, loaded on demand.

It measures what on-demand serving costs a client: each model's first request (a cold load) against
its second (resident), then requests/s from a few clients over a working set that fits the limit
against one that does not (every request may then wait for a load and an eviction). Then the
one-server run of issue 54 (the same models under ``ZIPF_LIMIT_MIB``, ``ZIPF_CLIENTS`` clients
asking with Zipf popularity for ``--residency-seconds``) and the shipped minilm's cold request
under on-demand control, first and after an unload.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from bench.common import RESULTS, ROOT, http_post, nograd_server, percentile, scrape_metrics
from bench.residency_models import ROWS, onnx_repository, remove_generated
from bench.session import Bench

CLIENTS = 4

ZIPF_LIMIT_MIB, ZIPF_CLIENTS = 256, 8
"""The one-server run: the phase's 24 ONNX models of 32 MiB under a 256 MiB limit (about seven
resident), eight clients (``--quick``: 8 models of 8 MiB under 64 MiB)."""
ZIPF_EXPONENT = 1.1
"""Model ``m<k>`` is asked for in proportion to ``1 / (k + 1) ** ZIPF_EXPONENT``, as a model
hub's traffic is: with about seven of 24 resident, some 70% of requests could be answered from
memory."""
MINILM_TEXT = "on-demand control loads a model on its first request"


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


def _closed_loop(
    url: str,
    models: list[str],
    seconds: float,
    clients: int = CLIENTS,
    weights: list[float] | None = None,
) -> dict[str, Any]:
    """``clients`` clients, each asking a model drawn from ``models`` in turn (uniformly, or in
    proportion to ``weights``); with ``weights``, the clients first ask once for every model
    between them, so each is asked."""
    latencies: list[float] = []
    wrong = 0
    answered: set[str] = set()
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(seed: int) -> None:
        nonlocal wrong
        rng = random.Random(seed)
        first = models[seed::clients] if weights is not None else []
        while time.monotonic() < stop or first:
            model = first.pop() if first else rng.choices(models, weights)[0]
            took, right = _infer(url, model)
            with lock:
                latencies.append(took)
                wrong += not right
                if right:
                    answered.add(model)

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    return {
        "models": len(models),
        "answered_models": len(answered),
        "requests": len(latencies),
        "wrong": wrong,
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
        "p99_ms": 1000 * percentile(latencies, 0.99) if latencies else None,
    }


def generated_models_env(repository: Path, limit_mib: int) -> dict[str, str]:
    """A server's settings for the run's generated models: on demand under ``limit_mib``, with an
    engine cache beside them, so the mapped forms of their ONNX files stay in the run's folder
    instead of adding a set per run to the user's engine cache."""
    return {
        "NOGRAD_MODEL_CONTROL": "on_demand",
        "NOGRAD_MEMORY_LIMIT_BYTES": f"{limit_mib}MiB",
        "NOGRAD_ENGINE_CACHE": str(repository.parent / "engines"),
    }


def _loads(url: str, metric: str = "nograd_model_loads_total") -> float:
    return sum(value for (name, _), value in scrape_metrics(url).items() if name == metric)


def _zipf_run(bench: Bench, repository: Path, count: int, weights_mib: int) -> dict[str, Any]:
    """The one-server run: every model of ``repository`` (``count`` of ``weights_mib``) asked
    for with Zipf popularity by ``ZIPF_CLIENTS`` clients for the plan's residency seconds, on a
    server of its own under ``ZIPF_LIMIT_MIB`` (``--quick``: 64 MiB; the eviction grace as
    shipped)."""
    limit_mib = 64 if bench.plan.quick else ZIPF_LIMIT_MIB
    env = generated_models_env(repository, limit_mib)
    names = [f"m{index}" for index in range(count)]
    popularity = [1 / (rank + 1) ** ZIPF_EXPONENT for rank in range(count)]
    with nograd_server(repository, bench.plan.server_cpus, env) as server:
        run = _closed_loop(server.url, names, bench.plan.residency_s, ZIPF_CLIENTS, popularity)
        run["loads"] = _loads(server.url)
        run["evictions"] = _loads(server.url, "nograd_model_evictions_total")
    return {
        **run,
        "weights_mib": weights_mib,
        "limit_mib": limit_mib,
        "clients": ZIPF_CLIENTS,
        "seconds": bench.plan.residency_s,
    }


def _minilm_cold(bench: Bench) -> dict[str, Any]:
    """The shipped minilm under on-demand control: its first request (a cold load, its engine
    choice remembered from earlier starts when there were any), its second (resident), and its
    first after an unload (loaded again in the same process)."""
    body = orjson.dumps(
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [MINILM_TEXT]}]}
    )
    timed: dict[str, Any] = {}
    with nograd_server(
        ROOT / "models", bench.plan.server_cpus, {"NOGRAD_MODEL_CONTROL": "on_demand"}
    ) as server:
        infer = f"{server.url}/v2/models/minilm/infer"
        for kind in ("cold_ms", "resident_ms", "unload", "reload_ms"):
            if kind == "unload":
                status, _ = http_post(f"{server.url}/v2/repository/models/minilm/unload", b"{}")
                timed["unloaded"] = status == 200
                continue
            started = time.perf_counter()
            status, _ = http_post(infer, body, timeout=300.0)
            timed[kind] = round(1000 * (time.perf_counter() - started), 1)
            timed[kind.replace("_ms", "_status")] = status
    return timed


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
    try:
        _measure_residency(bench, folder, record, fits, seconds)
    finally:
        remove_generated(folder)
    bench.note(
        f"residency: cold p50 {statistics.median(record['cold_ms']):.0f} ms, resident p50 "
        f"{statistics.median(record['resident_ms']):.1f} ms; fits {record['fits']['rps']:.0f} "
        f"req/s, exceeds {record['exceeds']['rps']:.0f} req/s; Zipf "
        f"{record['zipf']['rps']:.1f} req/s from {record['zipf']['answered_models']} of "
        f"{record['zipf']['models']} models ({record['zipf']['loads']:.0f} loads); minilm cold "
        f"{record['minilm']['cold_ms']:.0f} ms, after an unload "
        f"{record['minilm']['reload_ms']:.0f} ms"
    )


def _measure_residency(
    bench: Bench, folder: Path, record: dict[str, Any], fits: int, seconds: float
) -> None:
    """The phase's steps on models written under ``folder``, into ``record``."""
    count, weights_mib, limit_mib = record["models"], record["weights_mib"], record["limit_mib"]
    bench.step("residency: build the models")
    repository = onnx_repository(folder, count, weights_mib)
    env = generated_models_env(repository, limit_mib)
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
    bench.step("residency: one server, Zipf popularity")
    record["zipf"] = _zipf_run(bench, repository, count, weights_mib)
    bench.step("residency: minilm cold")
    record["minilm"] = _minilm_cold(bench)
