"""The revisions section: this checkout's nograd against a base revision, per workload and
concurrency the medians over the paired rounds and the medians of the per-round ratios."""

from __future__ import annotations

import statistics
from typing import Any

from bench.report.common import fmt, round_pairs, table

THIS = "nograd"
BASE = "nograd-base"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(pairs: list[dict[str, dict[str, Any]]], key: str) -> str:
    """The median of the per-round this ÷ base ratios of ``key``."""
    ratios = [p[THIS][key] / p[BASE][key] for p in pairs if p[BASE][key] > 0]
    return f"{fmt(_median(ratios), 3)}×"


def revision_rows(results: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Per workload and concurrency: the rounds both revisions ran, each one's median req/s and
    p99, the medians of the per-round this ÷ base ratios of req/s and p99, and failed
    requests."""
    found = results.get("revisions", {}).get("runs", [])
    rows = []
    for (workload, concurrency), pairs in round_pairs(found, THIS, BASE).items():
        rows.append(
            (
                workload,
                concurrency,
                len(pairs),
                _median([p[THIS]["rps"] for p in pairs]),
                _median([p[BASE]["rps"] for p in pairs]),
                _ratio(pairs, "rps"),
                _median([p[THIS]["p99_ms"] for p in pairs]),
                _median([p[BASE]["p99_ms"] for p in pairs]),
                _ratio(pairs, "p99_ms"),
                sum(int(p[s]["errors"]) for p in pairs for s in (THIS, BASE)),
            )
        )
    return rows


def revisions_section(results: dict[str, Any], tag: str) -> list[str]:
    record = results.get("revisions")
    if not record:
        return []
    this = str(record.get("this_commit", "–"))[:12] + (
        " (+ changes)" if record.get("this_dirty") else ""
    )
    base = str(record.get("base_commit", record.get("base", "–")))[:12]
    out = [f"## This revision against {base} ({tag})", ""]
    checks = record.get("check") or {}
    agreed = ", ".join(f"{n} {c['same']}/{c['requests']}" for n, c in checks.items())
    out.append(
        f"nograd at {this} and at {base}, both up together, each on its own revision's shipped "
        "models and both on one TorchServe MNIST archive, one engine cache, `NOGRAD_WORKERS="
        f"{record.get('workers', '–')}` each. Answers agreeing: {agreed or '–'}. Load: wrk, "
        "paired rounds (the other server paused, order reversed each round); medians over the "
        "rounds, ratios the medians of the per-round ratios."
    )
    out.append("")
    if record.get("refused"):
        out += [f"Not measured: {record['refused']}", ""]
    rows = revision_rows(results)
    if rows:
        header = (
            "workload",
            "concurrency",
            "rounds",
            "req/s (this)",
            "req/s (base)",
            "req/s this ÷ base",
            "p99 ms (this)",
            "p99 ms (base)",
            "p99 this ÷ base",
            "failed",
        )
        out += [table(header, rows), ""]
    return out
