"""The residency section: many models under one memory limit, loaded on demand: a cold request
against a resident one, and a working set that fits the limit against one that does not."""

from __future__ import annotations

import statistics
from typing import Any

from bench.common import percentile
from bench.report.common import table


def residency_section(results: dict[str, Any], tag: str) -> list[str]:
    record = results.get("residency")
    if not record or "cold_ms" not in record:
        return []
    out = [f"## Many models under one memory limit, loaded on demand ({tag})", ""]
    out.append(
        f"{record['models']} ONNX models of {record['weights_mib']} MiB of weights each, "
        "`NOGRAD_MODEL_CONTROL=on_demand` with "
        f"`NOGRAD_MEMORY_LIMIT_BYTES={record['limit_mib']}MiB`. "
        "Each model's first request loads it (after evicting others); its second finds it "
        f"resident. Then {record['clients']} clients for {record['seconds']:.0f} s, each asking "
        "a model drawn uniformly from a working set that fits the limit, then from all of them. "
        f"Answers from another model than the one asked: {record.get('wrong', '–')}."
    )
    out.append("")
    cold, warm = record["cold_ms"], record["resident_ms"]
    out.append(
        table(
            ("request", "p50 ms", "p99 ms", "max ms"),
            [
                (
                    "cold (loads the model)",
                    statistics.median(cold),
                    percentile(cold, 0.99),
                    max(cold),
                ),
                ("resident", statistics.median(warm), percentile(warm, 0.99), max(warm)),
            ],
        )
    )
    out.append("")
    rows = []
    for key, label in (("fits", "fits the limit"), ("exceeds", "exceeds the limit")):
        run = record.get(key) or {}
        rows.append(
            (
                f"{run.get('models', '–')} models ({label})",
                run.get("rps"),
                run.get("p50_ms"),
                run.get("p99_ms"),
                run.get("loads"),
                run.get("wrong"),
            )
        )
    out.append(table(("working set", "req/s", "p50 ms", "p99 ms", "loads", "wrong"), rows))
    out.append("")
    return out
