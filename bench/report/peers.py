"""The peers section: nograd against the best real peer per workload and concurrency (median of
per-round ratios), the targets with their verdicts, then each peer's set-up, answer check, sweep
and paired numbers."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from bench.report.common import fmt, table, verdict

NOGRAD = "nograd"
CEILING = "http-ceiling"
PYTRITON = "pytriton"
NOT_PEERS = (NOGRAD, CEILING)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _rounds(results: dict[str, Any], workload: str, concurrency: int) -> list[dict[str, Any]]:
    """Per round, its runs by system, for one workload and concurrency."""
    by_round: dict[int, dict[str, Any]] = {}
    for run in results.get("peers", {}).get("runs", []):
        if run["workload"] == workload and run["concurrency"] == concurrency:
            by_round.setdefault(run["round"], {})[run["system"]] = run
    return [by_round[k] for k in sorted(by_round)]


def _answered(run: dict[str, Any] | None) -> bool:
    """A run counts when it answered requests and failed none."""
    return run is not None and run["rps"] > 0 and run["errors"] == 0


@dataclass(frozen=True)
class VersusBest:
    """nograd against the best peer of each round, the medians of the per-round ratios."""

    workload: str
    concurrency: int
    best: str  # the peer that was best in most rounds
    rps: float | None
    p50: float | None
    p99: float | None
    nograd_p99_ms: float | None
    rounds: int


def versus_best(
    results: dict[str, Any], workload: str, concurrency: int, by_latency: bool
) -> VersusBest | None:
    """Per round the best peer (most requests/s, or lowest p50 with ``by_latency``) among the
    peers that answered every request, and nograd's ratios to it."""
    rps: list[float] = []
    p50: list[float] = []
    p99: list[float] = []
    own_p99: list[float] = []
    winners: list[str] = []
    for systems in _rounds(results, workload, concurrency):
        ours = systems.get(NOGRAD)
        peers = {s: r for s, r in systems.items() if s not in NOT_PEERS and _answered(r)}
        if ours is None or not _answered(ours) or not peers:
            continue
        if by_latency:
            name = min(peers, key=lambda s: peers[s]["p50_ms"])
        else:
            name = max(peers, key=lambda s: peers[s]["rps"])
        best = peers[name]
        winners.append(name)
        rps.append(ours["rps"] / best["rps"])
        p50.append(ours["p50_ms"] / best["p50_ms"] if best["p50_ms"] else float("nan"))
        p99.append(ours["p99_ms"] / best["p99_ms"] if best["p99_ms"] else float("nan"))
        own_p99.append(ours["p99_ms"])
    if not winners:
        return None
    return VersusBest(
        workload,
        concurrency,
        max(set(winners), key=winners.count),
        _median(rps),
        _median(p50),
        _median(p99),
        _median(own_p99),
        len(winners),
    )


def versus(results: dict[str, Any], workload: str, concurrency: int, other: str) -> float | None:
    """Median of the per-round throughput ratios nograd / ``other``."""
    values = [
        systems[NOGRAD]["rps"] / systems[other]["rps"]
        for systems in _rounds(results, workload, concurrency)
        if _answered(systems.get(NOGRAD)) and _answered(systems.get(other))
    ]
    return _median(values)


def _target(
    name: str, measured: float | None, threshold: float, at_least: bool, unit: str = "×"
) -> tuple[str, str, str, str, str]:
    """(target, measured, threshold, verdict, shortfall); a missed target's shortfall is the
    measured value over the threshold."""
    sign = "≥" if at_least else "≤"
    limit = f"{sign} {threshold:g}{'×' if unit == '×' else unit}"
    if measured is None:
        return (name, "–", limit, verdict(None), "not measured")
    met = measured >= threshold if at_least else measured <= threshold
    shortfall = "" if met else f"at {measured / threshold:.2f} of the target"
    return (name, f"{fmt(measured, 2)}{unit}", limit, verdict(met), shortfall)


def peer_targets(results: dict[str, Any], concurrency: int) -> list[tuple[str, ...]]:
    """The issue's targets against the real peers, each with its verdict and shortfall."""
    c = concurrency
    one = versus_best(results, "minilm-1", c, by_latency=False)
    low = versus_best(results, "minilm-1", 1, by_latency=True)
    eight = versus_best(results, "minilm-8", c, by_latency=False)

    def best(found: VersusBest | None) -> str:
        return f" ({found.best})" if found else ""

    p99 = _median(
        [
            systems[NOGRAD]["p99_ms"]
            for systems in _rounds(results, "digits", c)
            if _answered(systems.get(NOGRAD))
        ]
    )
    return [
        _target(
            f"minilm-1 c={c}: throughput vs best peer{best(one)}",
            one.rps if one else None,
            1.5,
            True,
        ),
        _target(f"minilm-1 c={c}: p99 vs best peer's", one.p99 if one else None, 0.6, False),
        _target(
            f"minilm-1 c=1: p50 vs best peer's{best(low)}", low.p50 if low else None, 0.7, False
        ),
        _target(
            f"minilm-8 c={c}: throughput vs best peer{best(eight)}",
            eight.rps if eight else None,
            1.5,
            True,
        ),
        _target(
            f"digits c={c}: throughput vs PyTriton", versus(results, "digits", c, PYTRITON), 3, True
        ),
        _target(
            f"digits c={c}: throughput vs HTTP ceiling",
            versus(results, "digits", c, CEILING),
            0.9,
            True,
        ),
        _target(f"digits c={c}: nograd p99", p99, 10, False, unit=" ms"),
    ]


def where_time_goes(results: dict[str, Any], concurrency: int) -> list[tuple[Any, ...]]:
    """nograd's own histograms over its paired runs: request, queue and batch time, batch size."""
    rows = []
    for workload in ("minilm-1", "minilm-8", "digits"):
        for c in sorted({concurrency, 1}, reverse=True):
            found = [s[NOGRAD] for s in _rounds(results, workload, c) if NOGRAD in s]
            if not found:
                continue

            def mean(key: str, found: list[dict[str, Any]] = found) -> float | None:
                values = [r["extra"].get(key) for r in found]
                return _median([float(v) for v in values if v is not None])

            rows.append(
                (
                    workload,
                    c,
                    fmt(mean("server_request_ms"), 2),
                    fmt(mean("server_queue_ms"), 2),
                    fmt(mean("server_batch_ms"), 2),
                    fmt(mean("mean_batch_size"), 1),
                    fmt(_median([r["p50_ms"] for r in found]), 2),
                    fmt(mean("server_cpu_cores"), 2),
                )
            )
    return rows


def _system_rows(results: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Every system's medians per workload and concurrency."""
    runs = results.get("peers", {}).get("runs", [])
    keys = sorted(
        {(r["workload"], r["concurrency"], r["system"]) for r in runs},
        key=lambda k: (k[0], -k[1], k[2] != NOGRAD, k[2]),
    )
    rows = []
    for workload, concurrency, system in keys:
        found = [
            r
            for r in runs
            if (r["workload"], r["concurrency"], r["system"]) == (workload, concurrency, system)
        ]
        rows.append(
            (
                workload,
                concurrency,
                system,
                _median([r["rps"] for r in found]),
                _median([r["p50_ms"] for r in found]),
                _median([r["p99_ms"] for r in found]),
                sum(r["errors"] for r in found),
                len(found),
            )
        )
    return rows


def peers_section(results: dict[str, Any], tag: str) -> list[str]:
    data = results.get("peers")
    if not data:
        return []
    c = results["meta"]["plan"]["concurrency"]
    parts = [
        f"## nograd against the real peers ({tag})",
        "",
        "Triton 2.51 (PyTriton 0.7.0), TorchServe 0.12.0 and infinity 0.0.78 (torch and ONNX "
        "engines), each in its own venv, serving the same weights; a peer's numbers count only "
        "after its answers matched nograd's. nograd, the HTTP ceiling (digits) and each peer at "
        "its best configuration ran in turn, the others paused, order reversed each round. "
        "Ratios are nograd / the round's best peer (most requests/s; lowest p50 at c=1), the "
        "median over rounds; a run that failed any request does not count.",
        "",
    ]
    versus_rows = []
    for workload in ("minilm-1", "minilm-8", "digits"):
        for concurrency in sorted({c, 1}, reverse=True):
            found = versus_best(results, workload, concurrency, by_latency=concurrency == 1)
            if found is not None:
                versus_rows.append(
                    (
                        workload,
                        concurrency,
                        found.best,
                        fmt(found.rps, 2),
                        fmt(found.p50, 2),
                        fmt(found.p99, 2),
                        found.rounds,
                    )
                )
    parts += [
        table(
            ["workload", "c", "best peer", "throughput ×", "p50 ×", "p99 ×", "rounds"],
            versus_rows,
        ),
        "",
        "### Targets",
        "",
        table(
            ["target", "measured", "threshold", "verdict", "shortfall"], peer_targets(results, c)
        ),
        "",
        "Where nograd's time goes (its own histograms, medians over rounds; ms):",
        "",
        table(
            [
                "workload",
                "c",
                "request",
                "queue",
                "batch",
                "rows per batch",
                "client p50",
                "server cores",
            ],
            where_time_goes(results, c),
        ),
        "",
        "### Every system (medians over rounds)",
        "",
        table(
            ["workload", "c", "system", "req/s", "p50 ms", "p99 ms", "failed", "rounds"],
            _system_rows(results),
        ),
        "",
    ]
    parts += _setup_parts(data)
    return parts


def _setup_parts(data: dict[str, Any]) -> list[str]:
    """Set-up, checks, refusals and the sweep."""
    parts = [
        "### Set-up",
        "",
        table(
            ["peer venv", "runs", "installed now", "seconds", "reason"],
            [
                (
                    name,
                    "yes" if env["ok"] else "no",
                    env["installed_now"],
                    env["seconds"],
                    env["reason"] or "",
                )
                for name, env in data.get("envs", {}).items()
            ],
        ),
        "",
        "### Answers against nograd's",
        "",
        table(
            ["system", "model", "workload", "passed", "requests", "min cosine", "max abs diff"],
            [
                (
                    check["system"],
                    check["model"],
                    check["workload"],
                    check["passed"],
                    check["requests"],
                    fmt(check["min_cosine"], 6),
                    fmt(check["max_abs_diff"], 6),
                )
                for check in _unique_checks(data.get("checks", []))
            ],
        ),
        "",
    ]
    if data.get("refused"):
        parts += [
            "Refused:",
            "",
            *[
                f"- {r['system']} {r['model']} {r['options']}: {r['reason']}"
                for r in data["refused"]
            ],
            "",
        ]
    parts += [
        "### Sweep (headline concurrency, each configuration once)",
        "",
        table(
            ["system", "workload", "configuration", "req/s", "p50 ms", "p99 ms", "failed"],
            [
                (
                    r["system"],
                    r["workload"],
                    r["label"],
                    r["rps"],
                    r["p50_ms"],
                    r["p99_ms"],
                    r["errors"],
                )
                for r in data.get("sweep", [])
            ],
        ),
        "",
    ]
    return parts


def _unique_checks(checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One check row per system and workload: the worst one."""
    worst: dict[tuple[str, str], dict[str, Any]] = {}
    for check in checks:
        key = (check["system"], check["workload"])
        if key not in worst or (not check["passed"] and worst[key]["passed"]):
            worst[key] = check
    return list(worst.values())
