"""Shared pieces of the report: system order and labels, number formatting, run lookups."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

NOISY_CORES = 0.3
SYSTEM_ORDER = (
    "nograd",
    "litserve",
    "fastapi",
    "http-ceiling",
    "http-ceiling-2",
    "nograd-batching-off",
    "nograd-threads-1",
    "nograd-threads-fewer",
    "nograd-workers-2",
)
LABELS = {
    "nograd": "nograd, one process",
    "litserve": "LitServe (best config)",
    "fastapi": "plain FastAPI",
    "http-ceiling": "HTTP ceiling (no model)",
    "http-ceiling-2": "HTTP ceiling, two processes (no model)",
    "nograd-batching-off": "nograd, batching off",
    "nograd-threads-1": "nograd, NOGRAD_TORCH_THREADS=1",
    "nograd-threads-fewer": "nograd, NOGRAD_TORCH_THREADS=cores − 1",
    "nograd-workers-2": "nograd, two workers (NOGRAD_WORKERS=2)",
}
AUTO_SYSTEM = {1: "nograd", 2: "nograd-workers-2"}
"""The bench's nograd system that matches what ``NOGRAD_WORKERS=auto`` starts."""


def default_processes(meta: dict[str, Any]) -> str:
    """What ``make run`` starts on the bench's machine, in words."""
    fronts = int(meta.get("default_fronts") or 0)
    if fronts:
        return f"one engine process and {fronts} fronts"
    workers = int(meta.get("auto_workers") or 1)
    return "one process" if workers == 1 else f"{workers} workers"


def default_system(meta: dict[str, Any]) -> str | None:
    """The bench's nograd system that matches what ``make run`` starts, if one does: the
    workers' systems only where the defaults plan no fronts."""
    if meta.get("default_fronts"):
        return None
    return AUTO_SYSTEM.get(int(meta.get("auto_workers") or 0))


COLORS = {
    "nograd": "tab:blue",
    "litserve": "tab:orange",
    "fastapi": "tab:green",
    "http-ceiling": "tab:gray",
}


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return "–"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(c) for c in row) + " |")
    return "\n".join(lines)


def runs(results: dict[str, Any], **match: Any) -> list[dict[str, Any]]:
    return [r for r in results.get("runs", []) if all(r.get(k) == v for k, v in match.items())]


def head(results: dict[str, Any], system: str, workload: str) -> dict[str, Any] | None:
    c = results["meta"]["plan"]["concurrency"]
    found = runs(results, system=system, workload=workload, mode="closed", concurrency=c)
    return found[0] if found else None


def litserve_best(
    results: dict[str, Any], workload: str, sweep: str = "litserve_sweep", system: str = "litserve"
) -> tuple[float, float] | None:
    """LitServe's highest samples/s and lowest p99 at the headline concurrency, over its headline
    run and every configuration of the sweep.

    LitServe's numbers move between runs of the same configuration (minilm-1: 133 req/s in the
    sweep, 88 in the headline run of that configuration, in run 20261122-050416); the targets
    compare with the best it showed anywhere in the run, the reading least kind to nograd.
    """
    c = results["meta"]["plan"]["concurrency"]
    found = [
        r
        for r in results.get(sweep, [])
        if r["workload"] == workload and r["concurrency"] == c and r["errors"] == 0
    ]
    headline = head(results, system, workload)
    if headline is not None:
        found.append(headline)
    if not found:
        return None
    return max(float(r["samples_per_s"]) for r in found), min(float(r["p99_ms"]) for r in found)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def round_pairs(
    found: Iterable[dict[str, Any]], this: str, other: str
) -> dict[tuple[str, int], list[dict[str, dict[str, Any]]]]:
    """Per workload and concurrency (in order), the paired rounds in which both ``this`` and
    ``other`` were measured, round by round: each round's run of every system, by system."""
    rounds: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for run in found:
        key = (run["workload"], run["concurrency"], run["round"])
        rounds.setdefault(key, {})[run["system"]] = run
    pairs: dict[tuple[str, int], list[dict[str, dict[str, Any]]]] = {}
    for (workload, concurrency, _), systems in sorted(rounds.items()):
        if this in systems and other in systems:
            pairs.setdefault((workload, concurrency), []).append(systems)
    return pairs


def cpu_us(run: dict[str, Any]) -> float | None:
    """Server CPU time per answered request (all its processes and threads), in µs."""
    cores = run["extra"].get("server_cpu_cores")
    if not cores or not run["rps"]:
        return None
    return float(cores) / float(run["rps"]) * 1e6


def noise(run: dict[str, Any]) -> str:
    """Other processes' CPU during a run, marked † when it disturbed the run."""
    foreign = float(run["extra"].get("foreign_cpu_cores", 0.0))
    return f"{foreign:.2f}{' †' if foreign > NOISY_CORES else ''}"


def verdict(ok: bool | None) -> str:
    return "–" if ok is None else ("**met**" if ok else "**not met**")
