"""One system at a time: the raw forward, nograd and its variants, the HTTP ceiling, FastAPI."""

from __future__ import annotations

import os
import shutil
from typing import Any

from bench.common import PYTHON, ROOT, Server, nograd_server
from bench.session import (
    MODEL_OF,
    QUIET_CORES,
    WORKERS_2,
    Bench,
    longest_tokens,
    pyspy,
    temp_repository,
    wait_workers,
)


# ----------------------------------------------------------------------------- phases
def phase_raw(bench: Bench) -> None:
    """The raw limit, retried like the load runs when other processes disturbed it."""
    # Full: three interleaved rounds of 0.5 s per batch size (bench.raw keeps each size's
    # best round); quick: one round.
    seconds, rounds = ("0.3", "1") if bench.plan.quick else ("0.5", "3")
    best: dict[str, Any] | None = None
    for attempt in range(1, bench.plan.attempts + 1):
        bench.step(f"raw model (no HTTP), attempt {attempt}")
        if bench.plan.attempts > 1:
            bench.quiet()
        result, foreign = bench.run_raw(["--seconds", seconds, "--rounds", rounds], 600)
        result["foreign_cpu_cores"] = foreign
        result["attempt"] = attempt
        if best is None or foreign < best["foreign_cpu_cores"]:
            best = result
        if foreign <= QUIET_CORES:
            break
        bench.noisy_retries += 1
    bench.results["raw"] = best


def phase_nograd(bench: Bench) -> None:
    server = nograd_server(ROOT / "models", bench.plan.server_cpus)
    bench.step("start nograd")
    with server:
        for name in bench.plan.workloads:
            bench.measure_system(server, "nograd", name, nograd_metrics=True)
        if bench.plan.profile:
            bench.results["pyspy"] = {}
            for name in ("digits", "minilm-1"):
                if name in bench.plan.workloads:
                    bench.step(f"py-spy nograd {name}")
                    bench.results["pyspy"][name] = pyspy(bench, server, name)


def phase_ceiling(bench: Bench) -> None:
    if "digits" not in bench.plan.workloads:
        return
    server = ceiling_server(bench)
    bench.step("start HTTP ceiling")
    with server:
        bench.measure_system(server, "http-ceiling", "digits")


def phase_fastapi(bench: Bench) -> None:
    for model in ("digits", "minilm"):
        names = [n for n in bench.plan.workloads if MODEL_OF[n] == model]
        if not names:
            continue
        server = Server(
            f"fastapi-{model}",
            [PYTHON, "-m", "bench.servers.fastapi_plain", "--model", model, "--port", "{port}"],
            "/v2/health/ready",
            cpus=bench.plan.server_cpus,
        )
        bench.step(f"start FastAPI {model}")
        with server:
            for name in names:
                bench.measure_system(server, "fastapi", name)


def phase_batching_off(bench: Bench) -> None:
    """nograd with batches of one: digits max_batch_size = 1; minilm's token cap = the
    longest tokenised text of the workload (no text is refused; two short ones may still
    share a batch, so the measured mean batch size is reported)."""
    longest = longest_tokens(bench)
    edits = {
        "digits": {"max_batch_size": "1"},
        "minilm": {"max_batch_tokens": str(longest)},
    }
    nograd_variant(bench, "nograd-batching-off", edits, {})


def phase_threads(bench: Bench) -> None:
    """nograd with one core fewer for torch (leaving one to the event loop) against its
    default of every core."""
    threads = str(max(1, (os.cpu_count() or 1) - 1))
    nograd_variant(bench, "nograd-threads-fewer", {}, {"NOGRAD_TORCH_THREADS": threads})


def phase_workers(bench: Bench) -> None:
    """nograd as two server processes (NOGRAD_WORKERS=2, sharing the cores batch by batch):
    for loads where one process's Python, not the forward, is the limit. minilm-1 also at
    concurrency 1, where a lone request's forward may take every core."""
    nograd_variant(bench, "nograd-workers-2", {}, WORKERS_2, low_load=True)


def ceiling_server(bench: Bench, processes: int = 1) -> Server:
    return Server(
        "ceiling" if processes == 1 else f"ceiling-{processes}",
        [
            *(PYTHON, "-m", "bench.servers.http_ceiling"),
            *("--port", "{port}", "--processes", str(processes)),
        ],
        "/v2/health/ready",
        cpus=bench.plan.server_cpus,
    )


def nograd_variant(
    bench: Bench,
    system: str,
    edits: dict[str, dict[str, str]],
    env: dict[str, str],
    *,
    low_load: bool = False,
) -> None:
    repo = temp_repository(edits) if edits else None
    try:
        server = nograd_server(repo or ROOT / "models", bench.plan.server_cpus, env)
        bench.step(f"start {system}")
        with server:
            wait_workers(server, int(env.get("NOGRAD_WORKERS", "1")))
            for name in bench.plan.workloads:
                result = bench.headline(
                    server, system, name, f"{system} {name}", nograd_metrics=True
                )
                if result is not None:
                    result.extra["config"] = edits.get(MODEL_OF[name], {}) | env
                if low_load and name == "minilm-1":
                    bench.step(f"{system} {name} c=1")
                    bench.load(
                        server,
                        system,
                        name,
                        concurrency=1,
                        duration_s=bench.plan.short_s,
                        nograd_metrics=True,
                    )
    finally:
        if repo is not None:
            shutil.rmtree(repo, ignore_errors=True)
