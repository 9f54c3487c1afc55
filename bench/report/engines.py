"""The engines section: nograd as shipped (engine = "auto") over the eager default, paired, and
each engine's raw forward speed."""

from __future__ import annotations

import statistics
from typing import Any

from bench.report.common import fmt, table


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def engine_ratio_rows(results: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Per workload and concurrency: both servers' median throughput, and the medians of the
    per-round ratios auto / eager of throughput, p50 and p99."""
    found = results.get("engines", {}).get("runs", [])
    rows = []
    for workload in sorted({r["workload"] for r in found}):
        for concurrency in sorted({r["concurrency"] for r in found if r["workload"] == workload}):
            by_round: dict[int, dict[str, dict[str, Any]]] = {}
            for run in found:
                if run["workload"] == workload and run["concurrency"] == concurrency:
                    by_round.setdefault(run["round"], {})[run["system"]] = run
            pairs = [(r["nograd"], r["nograd-eager"]) for r in by_round.values() if len(r) == 2]
            if not pairs:
                continue

            def ratios(
                key: str, pairs: list[tuple[dict[str, Any], dict[str, Any]]] = pairs
            ) -> float | None:
                return _median([a[key] / b[key] for a, b in pairs if b[key]])

            rows.append(
                (
                    workload,
                    concurrency,
                    _median([a["rps"] for a, _ in pairs]),
                    _median([b["rps"] for _, b in pairs]),
                    ratios("rps"),
                    ratios("p50_ms"),
                    ratios("p99_ms"),
                    len(pairs),
                )
            )
    return rows


def engines_section(results: dict[str, Any], tag: str) -> list[str]:
    data = results.get("engines")
    if not data:
        return []
    parts = [
        f'## Engines: nograd as shipped (engine = "auto") against eager ({tag})',
        "",
        "Both servers one process on the shipped repository, the eager one with "
        "`NOGRAD_ENGINE=eager`, measured in turn (the other paused), order reversed each "
        "round; ratios are auto / eager per round, then their median (docs/engines.md says "
        "what auto picks and why).",
        "",
        table(
            [
                "workload",
                "c",
                "auto req/s",
                "eager req/s",
                "throughput ratio",
                "p50 ratio",
                "p99 ratio",
                "rounds",
            ],
            [
                tuple(fmt(v, 2) if isinstance(v, float) else v for v in row)
                for row in engine_ratio_rows(results)
            ],
        ),
        "",
    ]
    raw = data.get("raw") or []
    if raw:
        parts += [
            "### Raw forward per engine (no HTTP; fastest of 7 passes)",
            "",
            table(
                [
                    "model",
                    "engine",
                    "batch 1 /s",
                    "batch 32 samples/s",
                    "batch 1 ms",
                    "batch 32 ms",
                    "vs eager",
                ],
                [
                    (
                        row["model"],
                        row["engine"],
                        row["batch1_per_s"],
                        row["batch32_per_s"],
                        fmt(row["batch1_ms"], 2),
                        fmt(row["batch32_ms"], 2),
                        row["accuracy"],
                    )
                    for row in raw
                ],
            ),
            "",
        ]
    return parts
