"""The paired rounds: per-round ratios, their medians, and the verdicts that head the report."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from bench.report.common import (
    LABELS,
    fmt,
    noise,
    ratio,
    table,
    verdict,
)
from bench.report.targets import _ge, _le


def paired_runs(results: dict[str, Any], system: str, workload: str) -> dict[int, dict[str, Any]]:
    """The paired phase's runs of one system on one workload, by round (``raw``: the raw
    forward's measurement beside that workload)."""
    paired = results.get("paired", {})
    if system == "raw":
        return {r["round"]: r for r in paired.get("raw", []) if r["workload"] == workload}
    found = paired.get("runs", [])
    return {r["round"]: r for r in found if r["system"] == system and r["workload"] == workload}


def paired_ratios(
    results: dict[str, Any],
    workload: str,
    system: str,
    other: str,
    key: str,
    other_key: str | None = None,
) -> list[float]:
    """``system``'s ``key`` over ``other``'s (``other_key``, default the same), one ratio per
    round in which both were measured."""
    return round_ratios(
        results,
        workload,
        system,
        other,
        lambda run: float(run[key]),
        lambda run: float(run[other_key or key]),
    )


def round_ratios(
    results: dict[str, Any],
    workload: str,
    system: str,
    other: str,
    value: Callable[[dict[str, Any]], float | None],
    other_value: Callable[[dict[str, Any]], float | None] | None = None,
) -> list[float]:
    """``value`` of ``system``'s run over ``other_value`` (default ``value``) of ``other``'s,
    one ratio per round in which both were measured (and both values are known)."""
    mine = paired_runs(results, system, workload)
    theirs = paired_runs(results, other, workload)
    out = []
    for index in sorted(mine.keys() & theirs.keys()):
        found = ratio(value(mine[index]), (other_value or value)(theirs[index]))
        if found is not None:
            out.append(found)
    return out


def median_of(values: Sequence[float], unit: str) -> tuple[float | None, str]:
    """The median and the text showing it with every round's value."""
    if not values:
        return None, "–"
    middle = statistics.median(values)
    return middle, f"{fmt(middle, 2)}{unit} ({' / '.join(fmt(v, 2) for v in values)})"


def _median_p99(runs: dict[int, dict[str, Any]]) -> tuple[float | None, str]:
    """The median p99 over rounds (runs keyed by round), with every round's value."""
    return median_of([float(r["p99_ms"]) for _, r in sorted(runs.items())], " ms")


def paired_targets(
    results: dict[str, Any], system: str = "nograd"
) -> list[tuple[str, str, str, str]]:
    """Issue 5's targets that compare servers, from the paired rounds: the median over rounds of
    each round's ratio (every ratio's two runs minutes apart at most, at the same machine speed).
    """
    out: list[tuple[str, str, str, str]] = []
    # (workload, other system, key, other's key, label, bound, at least)
    checks: list[tuple[str, str, str, str, str, float, bool]] = []
    rps, samples = "rps", "samples_per_s"
    digits = paired_runs(results, system, "digits")
    if digits:
        checks += [
            ("digits", "http-ceiling", rps, rps, "throughput vs HTTP ceiling", 0.7, True),
            ("digits", "litserve", samples, samples, "throughput vs LitServe", 3.0, True),
        ]
    for workload in ("minilm-1", "minilm-8"):
        if paired_runs(results, system, workload):
            checks += [
                (workload, "raw", samples, samples, "throughput vs raw model best", 0.85, True),
                (
                    workload,
                    "raw",
                    samples,
                    "packed_samples_per_s",
                    "throughput vs nograd's packed forward, raw loop (stricter)",
                    0.85,
                    True,
                ),
                (workload, "litserve", samples, samples, "throughput vs LitServe", 1.6, True),
                (workload, "litserve", "p99_ms", "p99_ms", "p99 vs LitServe", 0.7, False),
            ]
    for workload, other, key, other_key, label, bound, at_least in checks:
        values = paired_ratios(results, workload, system, other, key, other_key)
        if not values:
            continue
        middle, shown = median_of(values, "×")
        ok = _ge(middle, bound) if at_least else _le(middle, bound)
        sign = "≥" if at_least else "≤"
        out.append((f"{workload}: {label}", shown, f"{sign} {bound:g}×", verdict(ok)))
    if digits:
        # An absolute bound, not a ratio: the median of nograd's own p99 over the rounds.
        middle, shown = _median_p99(digits)
        rows = [("digits: p99 latency", shown, "≤ 20 ms", verdict(_le(middle, 20.0)))]
        # Context, no verdicts: the bare HTTP stack in the same rounds, as the issue defines its
        # ceiling (one process) and in two processes (its limit on two cores).
        for ceiling, name, with_ratio in (
            ("http-ceiling", "HTTP ceiling", False),  # its ratio is a target above
            ("http-ceiling-2", "two-process HTTP ceiling", True),
        ):
            bare = paired_runs(results, ceiling, "digits")
            if not bare:
                continue
            if with_ratio:
                values = paired_ratios(results, "digits", system, ceiling, rps)
                label = f"digits: throughput vs the {name} (context)"
                rows.append((label, median_of(values, "×")[1], "–", "–"))
            _, tail = _median_p99(bare)
            rows.append((f"digits: the {name}'s own p99 (context)", tail, "–", "–"))
        at = sum(1 for target, *_ in out if target.startswith("digits"))
        out[at:at] = rows
    return out


def paired_section(results: dict[str, Any], tag: str) -> list[str]:
    found = results.get("paired", {}).get("runs", [])
    if not found:
        return []
    c = results["meta"]["plan"]["concurrency"]
    rounds = max(r["round"] for r in found)
    parts = [
        f"## Targets from paired rounds ({tag}, concurrency {c}, {rounds} rounds)",
        "",
        "Every system below was started once and measured in turn on each workload (the others "
        "paused with SIGSTOP, so an idle server that polls takes no CPU from the one under "
        "load), round after round, the order reversed each round. Each round "
        "gives its own ratio of two runs at most minutes apart; the verdict takes the median "
        "over rounds (every round's value in brackets). LitServe runs the best configuration "
        "its sweep found; the raw minilm forward (padded, and nograd's packed one, at 16, 32 and "
        "64 rows, its best) runs in its own process beside each minilm workload, every server "
        "paused. The concurrency-1 target is in the per-phase table.",
        "",
    ]
    for system in ("nograd", "nograd-workers-2"):
        rows = paired_targets(results, system)
        if rows:
            parts += [f"### {LABELS[system]}", ""]
            parts += [table(("target", "median of rounds", "target", "verdict"), rows), ""]
    every: list[Sequence[Any]] = []
    for r in sorted(found, key=lambda r: (r["workload"], r["round"], r["position"])):
        extra = r["extra"]
        every.append(
            (
                r["workload"],
                r["round"],
                LABELS.get(r["system"], r["system"]),
                r["rps"],
                r["samples_per_s"],
                r["p50_ms"],
                r["p99_ms"],
                r["errors"],
                fmt(extra["mean_batch_size"], 1) if "mean_batch_size" in extra else "",
                noise(r),
            )
        )
    header = (
        "workload",
        "round",
        "system",
        "req/s",
        "samples/s",
        "p50 ms",
        "p99 ms",
        "errors",
        "mean batch",
        "foreign CPU",
    )
    parts += [f"### Every paired run ({tag}, c={c}; within a round, in the order run)", ""]
    parts += [table(header, every), ""]
    raw = results.get("paired", {}).get("raw", [])
    if raw:
        raw_rows = [
            (
                r["workload"],
                r["round"],
                r["samples_per_s"],
                r["batch"],
                r["packed_samples_per_s"],
                r["packed_batch"],
                fmt(r["foreign_cpu_cores"], 2),
            )
            for r in sorted(raw, key=lambda r: (r["workload"], r["round"]))
        ]
        raw_header = (
            "beside workload",
            "round",
            "raw samples/s",
            "at batch",
            "packed samples/s",
            "at batch",
            "foreign CPU",
        )
        parts += [f"### The raw minilm forward in the paired rounds ({tag})", ""]
        parts += [table(raw_header, raw_rows), ""]
    return parts
