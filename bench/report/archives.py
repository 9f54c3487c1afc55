"""The archives section: nograd and TorchServe serving the same ``mnist.mar``, per concurrency the
medians over the paired rounds and the median of the per-round nograd / TorchServe ratios."""

from __future__ import annotations

import statistics
from typing import Any

from bench.report.common import fmt, table

NOGRAD = "nograd"
TORCHSERVE = "torchserve"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def archive_rows(results: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Per concurrency (highest first): rounds, nograd's and TorchServe's median req/s, p50 and
    p99, the median per-round throughput and p99 ratios, both systems' failed requests, and the
    median CPU other processes took during the runs (a shared machine's noise)."""
    by_key: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for run in results.get("archives", {}).get("runs", []):
        by_key.setdefault((run["concurrency"], run["round"]), {})[run["system"]] = run
    rows = []
    for concurrency in sorted({c for c, _ in by_key}, reverse=True):
        rounds = [
            systems
            for (c, _), systems in sorted(by_key.items())
            if c == concurrency and NOGRAD in systems and TORCHSERVE in systems
        ]
        if not rounds:
            continue

        def median_of(system: str, key: str, rounds: list[dict[str, dict[str, Any]]]) -> Any:
            return _median([float(r[system][key]) for r in rounds])

        rps_ratio = _median(
            [r[NOGRAD]["rps"] / r[TORCHSERVE]["rps"] for r in rounds if r[TORCHSERVE]["rps"] > 0]
        )
        p99_ratio = _median(
            [
                r[NOGRAD]["p99_ms"] / r[TORCHSERVE]["p99_ms"]
                for r in rounds
                if r[TORCHSERVE]["p99_ms"] > 0
            ]
        )
        errors = [sum(int(r[s]["errors"]) for r in rounds) for s in (NOGRAD, TORCHSERVE)]
        foreign = _median(
            [float(r[s].get("extra", {}).get("foreign_cpu_cores", 0.0)) for r in rounds for s in r]
        )
        rows.append(
            (
                concurrency,
                len(rounds),
                median_of(NOGRAD, "rps", rounds),
                median_of(NOGRAD, "p50_ms", rounds),
                median_of(NOGRAD, "p99_ms", rounds),
                median_of(TORCHSERVE, "rps", rounds),
                median_of(TORCHSERVE, "p50_ms", rounds),
                median_of(TORCHSERVE, "p99_ms", rounds),
                f"{fmt(rps_ratio, 2)}×",
                f"{fmt(p99_ratio, 2)}×",
                f"{errors[0]} / {errors[1]}",
                foreign,
            )
        )
    return rows


def archives_section(results: dict[str, Any], tag: str) -> list[str]:
    record = results.get("archives")
    if not record:
        return []
    out = [f"## The same TorchServe archive: nograd and TorchServe ({tag})", ""]
    check = record.get("check") or {}
    out.append(
        f"TorchServe's MNIST example (`{record.get('archive')}`, its custom handler, batchSize "
        f"{record.get('batch_size', '–')} and maxBatchDelay 200 ms from its model-config.yaml), "
        "built once with torch-model-archiver; nograd (`NOGRAD_WORKERS="
        f"{record.get('nograd_workers', '–')}`) and TorchServe "
        f"({record.get('torchserve_version', '–')}) serve the same model store. "
        f"Answers compared: {check.get('same', '–')} of {check.get('requests', '–')} the same. "
        "Load: wrk, `PUT /predictions/mnist` with one 28×28 PNG per request, both systems in "
        "paired rounds (the other paused, order reversed each round); medians over the rounds."
    )
    out.append("")
    if record.get("refused"):
        out += [f"Not measured: {record['refused']}", ""]
    rows = archive_rows(results)
    if rows:
        header = (
            "concurrency",
            "rounds",
            "nograd req/s",
            "nograd p50 ms",
            "nograd p99 ms",
            "TorchServe req/s",
            "TorchServe p50 ms",
            "TorchServe p99 ms",
            "nograd/TorchServe req/s",
            "p99 ratio",
            "failed (nograd / TorchServe)",
            "other processes' CPU (cores)",
        )
        out += [table(header, rows), ""]
    return out
