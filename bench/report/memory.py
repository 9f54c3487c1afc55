"""Report section: memory-sized batches (fitted cost models, limits, served under a budget)."""

from __future__ import annotations

from typing import Any

from bench.report.common import (
    table,
)


def memory_section(results: dict[str, Any], tag: str) -> list[str]:
    memory = results.get("memory")
    if not memory:
        return []
    out = [f"## Memory-sized batches (issue 3) ({tag})", ""]
    rows: list[tuple[Any, ...]] = []
    for model, p in memory["profiles"].items():
        check = p["check"]
        rows.append(
            (
                model,
                p["unit"],
                kib(p["weights_bytes"]),
                kib(p["fixed_bytes"]),
                f"{p['per_unit_bytes']:,.0f}",
                f"{p['quadratic_bytes']:.2f}",
                f"{check['rows']}×{check['length']}",
                kib(check["measured_bytes"]),
                kib(check["predicted_bytes"]),
                f"{100 * check['relative_error']:.1f}%",
            )
        )
    out += [
        "### Fitted cost model: bytes = fixed + per_unit × n (+ quadratic × rows × len²)",
        "",
        table(
            (
                "model",
                "unit",
                "weights KiB",
                "fixed KiB",
                "B per unit",
                "quadratic B",
                "check point",
                "measured KiB",
                "predicted KiB",
                "error",
            ),
            rows,
        ),
        "",
    ]
    rows = []
    for model, p in memory["profiles"].items():
        for b in p["budgets"]:
            peak = b.get("measured_peak_bytes")
            rows.append(
                (
                    model,
                    kib(b["budget_bytes"])
                    + ("" if b["explicit"] else " (default: 0.9 × available)"),
                    f"{b['limit']} {b['unit']}s",
                    "–"
                    if peak is None
                    else f"{kib(peak)} ({b['measured_rows']}×{b['measured_length']})",
                    "–" if peak is None else ("yes" if peak <= b["budget_bytes"] else "**no**"),
                )
            )
    out += [
        "### Derived batch limit per budget (plan_device, one model per device)",
        "",
        table(("model", "budget KiB", "limit", "measured peak at the limit", "fits"), rows),
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
