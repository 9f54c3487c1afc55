"""LitServe: its batching configurations swept, then its best measured at every load."""

from __future__ import annotations

from typing import Any

from bench.common import PYTHON, Server
from bench.session import (
    MODEL_OF,
    Bench,
)


def litserve(
    bench: Bench, model: str, batch: int, timeout_s: float, packed: bool = False
) -> Server:
    return Server(
        f"litserve-{model}-{batch}-{timeout_s:g}{'-packed' if packed else ''}",
        [
            PYTHON,
            "-m",
            "bench.servers.litserve_server",
            "--model",
            model,
            "--port",
            "{port}",
            "--max-batch-size",
            str(batch),
            "--batch-timeout",
            str(timeout_s),
            *(["--packed"] if packed else []),
        ],
        "/health",
        cpus=bench.plan.server_cpus,
    )


def phase_litserve(bench: Bench) -> None:
    sweep: list[dict[str, Any]] = []
    for model in ("digits", "minilm"):
        names = [n for n in bench.plan.workloads if MODEL_OF[n] == model]
        if not names:
            continue
        sweep += litserve_sweep(bench, model, names)
    bench.results["litserve_sweep"] = sweep
    best: dict[str, tuple[int, float]] = {}
    for name in bench.plan.workloads:
        rows = [s for s in sweep if s["workload"] == name]
        if rows:
            top = max(rows, key=lambda s: (s["rps"], -s["p99_ms"]))
            best[name] = (top["max_batch_size"], top["batch_timeout"])
    bench.results["litserve_best"] = {
        k: {"max_batch_size": b, "batch_timeout": t} for k, (b, t) in best.items()
    }
    groups: dict[tuple[str, int, float], list[str]] = {}
    for name, (batch, timeout_s) in best.items():
        groups.setdefault((MODEL_OF[name], batch, timeout_s), []).append(name)
    for (model, batch, timeout_s), names in groups.items():
        bench.step(f"start LitServe best {model} {batch}/{timeout_s:g}")
        with litserve(bench, model, batch, timeout_s) as server:
            for name in names:
                head = bench.measure_system(server, "litserve", name)
                if head is not None:
                    head.extra.update({"max_batch_size": batch, "batch_timeout": timeout_s})


def phase_litserve_packed(bench: Bench) -> None:
    """LitServe running nograd's packed minilm forward: the same sweep at concurrency 32, its
    best kept as ``litserve-packed``. Separates what nograd's serving adds from what its model
    code (padding skipped) adds, which a LitServe user could write too."""
    names = [n for n in bench.plan.workloads if MODEL_OF[n] == "minilm"]
    if not names:
        return
    bench.results["litserve_packed_sweep"] = litserve_sweep(bench, "minilm", names, packed=True)


def litserve_sweep(
    bench: Bench, model: str, names: list[str], packed: bool = False
) -> list[dict[str, Any]]:
    """Every max_batch_size × batch_timeout of the plan at the headline concurrency."""
    system = "litserve-packed-sweep" if packed else "litserve-sweep"
    sweep: list[dict[str, Any]] = []
    for batch, timeout_s in bench.plan.litserve_grid:
        bench.step(f"LitServe {model}{' packed' if packed else ''} mbs={batch} t={timeout_s:g}")
        with litserve(bench, model, batch, timeout_s, packed=packed) as server:
            for name in names:
                bench.warm(server, name)
                result = bench.load(server, system, name, duration_s=bench.plan.sweep_s)
                if result is None:
                    continue
                result.extra.update({"max_batch_size": batch, "batch_timeout": timeout_s})
                sweep.append(
                    {"workload": name, "max_batch_size": batch, "batch_timeout": timeout_s}
                    | result.as_dict()
                )
    return sweep
