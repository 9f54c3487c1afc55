"""The residency section: many models under one memory limit, loaded on demand: a cold request
against a resident one, a working set that fits the limit against one that does not, the
one-server run with Zipf popularity and minilm's cold request."""

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
    out += _zipf_lines(record.get("zipf"))
    out += _minilm_lines(record.get("minilm"))
    return out


def _zipf_lines(run: dict[str, Any] | None) -> list[str]:
    """The one-server run of many models with Zipf popularity, when the phase recorded it."""
    if not run:
        return []
    text = (
        f"One server, {run['models']} models of {run['weights_mib']} MiB under "
        f"`NOGRAD_MEMORY_LIMIT_BYTES={run['limit_mib']}MiB`, {run['clients']} clients asking "
        f"with Zipf popularity for {run['seconds']:.0f} s (each model asked at least once)."
    )
    columns = ("req/s", "p50 ms", "p99 ms", "models answered", "loads", "evictions", "wrong")
    row = (
        run.get("rps"),
        run.get("p50_ms"),
        run.get("p99_ms"),
        f"{run.get('answered_models', '–')} of {run['models']}",
        run.get("loads"),
        run.get("evictions"),
        run.get("wrong"),
    )
    return [text, "", table(columns, [row]), ""]


def _minilm_lines(timed: dict[str, Any] | None) -> list[str]:
    """minilm's cold request under on-demand control, when the phase recorded it."""
    if not timed:
        return []
    rows = [
        ("first request (loads it)", timed.get("cold_ms"), timed.get("cold_status")),
        ("second (resident)", timed.get("resident_ms"), timed.get("resident_status")),
        ("first after an unload", timed.get("reload_ms"), timed.get("reload_status")),
    ]
    return [
        "The shipped minilm under `NOGRAD_MODEL_CONTROL=on_demand`:",
        "",
        table(("minilm request", "ms", "status"), rows),
        "",
    ]
