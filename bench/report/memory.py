"""Report section: memory-sized batches (each engine's fitted cost, limits, served under a
budget)."""

from __future__ import annotations

from typing import Any

from bench.report.common import (
    table,
)


def memory_section(results: dict[str, Any], tag: str) -> list[str]:
    memory = results.get("memory")
    if not memory:
        return []
    out = [f"## Memory-sized batches, measured per engine ({tag})", ""]
    rows: list[tuple[Any, ...]] = []
    for model, engines in memory["profiles"].items():
        for forced, p in engines.items():
            for r in p["ranges"]:
                check = r["check"]
                rows.append(
                    (
                        model,
                        forced,
                        r["engine"]
                        if r["most_rows"] is None
                        else f"{r['engine']}<={r['most_rows']}",
                        kib(r["fixed_bytes"]),
                        f"{r['per_unit_bytes']:,.0f} B/{p['unit']}",
                        f"{r['quadratic_bytes']:.2f}",
                        f"{check['rows']}×{check['length']}",
                        kib(check["measured_bytes"]),
                        kib(check["predicted_bytes"]),
                        r["verdict"],
                        ", ".join(f"{100 * e:+.1f}%" for e in r["errors"]),
                    )
                )
    out += [
        "### Fitted cost per engine: bytes = fixed + per_unit × n (+ quadratic × rows × len²), "
        "measured as each engine allocates (process resident peak on CPU)",
        "",
        table(
            (
                "model",
                "engine forced",
                "serving range",
                "fixed KiB",
                "per unit",
                "quadratic B",
                "check point",
                "measured KiB",
                "predicted KiB",
                "verdict",
                "check errors",
            ),
            rows,
        ),
        "",
    ]
    rows = []
    for model, engines in memory["profiles"].items():
        for forced, p in engines.items():
            for b in p["budgets"]:
                peak = b.get("measured_peak_bytes")
                measured = (
                    "–"
                    if peak is None
                    else f"{kib(peak)} ({b['measured_rows']}×{b['measured_length']})"
                )
                rows.append(
                    (
                        model,
                        forced,
                        kib(b["budget_bytes"]),
                        f"{b['limit']} {p['unit']}s",
                        "–" if peak is None else f"{b['planned_unit_bytes']:,.0f} B/{p['unit']}",
                        "–" if peak is None else kib(b["predicted_bytes"]),
                        measured,
                        "–" if peak is None else f"{100 * peak / b['budget_bytes']:.0f}%",
                    )
                )
    out += [
        "### Batch limit per budget, and a batch at the limit: planned against measured",
        "",
        table(
            (
                "model",
                "engine",
                "budget KiB",
                "limit",
                "planned per unit",
                "predicted KiB",
                "measured peak KiB",
                "peak / budget",
            ),
            rows,
        ),
        "",
    ]
    served = memory.get("served", [])
    if served:
        rows = []
        for s in served:
            load = s["load"]
            rows.append(
                (
                    s["label"],
                    load["rps"],
                    load["p99_ms"],
                    load["errors"],
                    s["mean_batch_size"],
                    s["max_batch_at_most"],
                    s["batch_limit_end"],
                    s["oom_total"],
                    s["batch_splits_total"],
                    (
                        ", ".join(
                            f"{code}: {int(n)}"
                            for code, n in sorted(s["codes"].items())
                            if code != "200"
                        )
                        or "none"
                    )
                    if "codes" in s
                    else f"{int(s.get('non_200', 0))} (codes not recorded)",
                )
            )
        out += [
            f"### Served under a budget (nograd, wrk c=32, {tag})",
            "",
            table(
                (
                    "run",
                    "req/s",
                    "p99 ms",
                    "errors",
                    "mean batch",
                    "largest batch ≤",
                    "limit at end",
                    "nograd_oom_total",
                    "nograd_batch_splits_total",
                    "non-200 answers (server life)",
                ),
                rows,
            ),
            "",
        ]
    return out


def kib(value: float) -> str:
    return f"{value / 1024:,.1f}"
