"""The archives section: nograd and TorchServe serving the same ``mnist.mar``, per concurrency the
medians over the paired rounds and the median of the per-round nograd / TorchServe ratios."""

from __future__ import annotations

import statistics
from typing import Any

from bench.report.common import default_processes, fmt, table

TORCHSERVE = "torchserve"
LABELS = {
    "nograd": "nograd as shipped (`make run`'s processes)",
    "nograd-workers-1": "nograd, one process",
    TORCHSERVE: "TorchServe",
}


def _shipped(record: dict[str, Any]) -> str:
    """The processes nograd ran as shipped, from the record (older runs name only workers)."""
    return default_processes(
        {
            "default_fronts": record.get("nograd_default_fronts"),
            "auto_workers": record.get("nograd_workers"),
        }
    )


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def archive_rows(results: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Per concurrency (highest first) and system (nograd's first, TorchServe last): the rounds
    in which TorchServe was measured too, the median req/s, p50 and p99, the medians of the
    per-round req/s and p99 ratios to TorchServe, failed requests, and the median CPU other
    processes took during the system's runs (a shared machine's noise)."""
    by_key: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for run in results.get("archives", {}).get("runs", []):
        by_key.setdefault((run["concurrency"], run["round"]), {})[run["system"]] = run
    rows = []
    for concurrency in sorted({c for c, _ in by_key}, reverse=True):
        rounds = [
            systems
            for (c, _), systems in sorted(by_key.items())
            if c == concurrency and TORCHSERVE in systems
        ]
        names = sorted({s for r in rounds for s in r}, key=lambda s: (s == TORCHSERVE, s))
        for system in names:
            mine = [r for r in rounds if system in r]
            runs = [r[system] for r in mine]
            rps = _median([float(run["rps"]) for run in runs])
            rps_ratio = _median(
                [r[system]["rps"] / r[TORCHSERVE]["rps"] for r in mine if r[TORCHSERVE]["rps"] > 0]
            )
            p99_ratio = _median(
                [
                    r[system]["p99_ms"] / r[TORCHSERVE]["p99_ms"]
                    for r in mine
                    if r[TORCHSERVE]["p99_ms"] > 0
                ]
            )
            rows.append(
                (
                    concurrency,
                    LABELS.get(system, system),
                    len(runs),
                    rps,
                    _median([float(run["p50_ms"]) for run in runs]),
                    _median([float(run["p99_ms"]) for run in runs]),
                    f"{fmt(rps_ratio, 2)}×",
                    f"{fmt(p99_ratio, 2)}×",
                    sum(int(run["errors"]) for run in runs),
                    _median(
                        [float(run.get("extra", {}).get("foreign_cpu_cores", 0.0)) for run in runs]
                    ),
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
        "built once with torch-model-archiver; nograd (as shipped: "
        f"{_shipped(record)} here, and one process like the "
        "archive's one TorchServe worker) and TorchServe "
        f"({record.get('torchserve_version', '–')}) serve the same model store. "
        f"Answers compared: {check.get('same', '–')} of {check.get('requests', '–')} the same. "
        "Load: wrk, `PUT /predictions/mnist` with one 28×28 PNG per request, every system in "
        "paired rounds (the others paused, order reversed each round); medians over the rounds, "
        "ratios the medians of the per-round ratios."
    )
    out.append("")
    if record.get("refused"):
        out += [f"Not measured: {record['refused']}", ""]
    rows = archive_rows(results)
    if rows:
        header = (
            "concurrency",
            "system",
            "rounds",
            "req/s",
            "p50 ms",
            "p99 ms",
            "req/s ÷ TorchServe's",
            "p99 ÷ TorchServe's",
            "failed",
            "other processes' CPU (cores)",
        )
        out += [table(header, rows), ""]
    return out
