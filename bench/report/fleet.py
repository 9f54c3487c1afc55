"""The fleet section: replicas behind HAProxy, model-aware balancing against round robin round
by round, then what a rolling restart and a scale cost the clients under load."""

from __future__ import annotations

from typing import Any

from bench.report.common import fmt, table


def _failures(run: dict[str, Any]) -> str:
    kinds = run.get("failures") or {}
    if not kinds:
        return "0"
    return f"{run['failed']} (" + ", ".join(f"{kind}: {n}" for kind, n in kinds.items()) + ")"


def _ratio(value: float | None, met: bool, sign: str, target: float) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}x ({'meets' if met else 'misses'} {sign} {target:g}x)"


def fleet_section(results: dict[str, Any], tag: str) -> list[str]:
    record = results.get("fleet")
    if not record or not record.get("runs"):
        return []
    out = [f"## Many models across a fleet behind HAProxy ({tag})", ""]
    out.append(
        f"`nograd fleet up --replicas {record['replicas']}` on one machine: each replica "
        "`NOGRAD_MODEL_CONTROL=on_demand` with "
        f"`NOGRAD_MEMORY_LIMIT_BYTES={record['limit_mib']}MiB`, {record['models']} ONNX models "
        f"of {record['weights_mib']} MiB, {record['clients']} clients asking with Zipf popularity "
        f"(exponent {record['zipf_exponent']}) for {record['seconds']:.0f} s on a fresh fleet, "
        "model-aware balancing (`--balance model`) and `--balance roundrobin` in "
        f"{record['rounds']} paired round(s), the order alternating. Loads: the replicas' "
        "`nograd_model_loads_total` over the run and over its second half; models: those "
        "answered; wrong: answers from another model than the one asked."
    )
    out.append("")
    rows = [
        (
            run["round"] + 1,
            run["balance"],
            run["answered"],
            run["rps"],
            run["p50_ms"],
            run["p99_ms"],
            run["loads"],
            run.get("loads_second_half"),
            f"{run['models_answered']}/{record['models']}",
            run["wrong"],
            _failures(run),
        )
        for run in record["runs"]
    ]
    header: tuple[str, ...] = ("round", "balance", "answered", "req/s", "p50 ms", "p99 ms")
    header += ("loads", "2nd half", "models")
    out.append(table((*header, "wrong", "failed"), rows))
    out.append("")
    for run in record["runs"]:
        held = run.get("placement") or {}
        if held:
            out.append(
                f"Resident at the end of round {run['round'] + 1}, {run['balance']}: "
                + ", ".join(
                    f"replica {slot}: {len(one['resident'])} models, {fmt(one['used_mib'])} MiB"
                    for slot, one in sorted(held.items())
                )
                + "."
            )
    out.append("")
    found = record.get("ratios") or {}
    out.append(
        "Model-aware against round robin, median of the rounds: "
        + _ratio(found.get("requests_median"), found.get("requests_met", False), "≥", 2.0)
        + " the requests answered, "
        + _ratio(found.get("loads_median"), found.get("loads_met", False), "≤", 0.25)
        + " the cold loads ("
        + fmt(found.get("loads_per_answer_median"), 2)
        + "x the loads per request answered)."
    )
    out.append("")
    changes = [
        (label, record[key])
        for key, label in (
            ("rolling_restart", "`nograd fleet rolling-restart`"),
            ("scale", f"`nograd fleet scale --replicas {record['scaled_replicas']}`"),
        )
        if key in record
    ]
    if changes:
        out.append(
            "Under the same clients (model-aware balancing), while each command ran; failed: "
            "any status but 200 (a 503 too) or a broken connection."
        )
        out.append("")
        out.append(
            table(
                ("command", "command s", "answered", "p99 ms", "wrong", "failed", "homes moved"),
                [
                    (
                        label,
                        change["command_s"],
                        change["answered"],
                        change["p99_ms"],
                        change["wrong"],
                        _failures(change),
                        fmt(100 * change["moved_share"], 0) + " %"
                        if "moved_share" in change
                        else "–",
                    )
                    for label, change in changes
                ],
            )
        )
        out.append("")
    return out
