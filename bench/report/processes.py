"""The processes section: nograd's engine process with fronts against its workers, per system
the processes, memory, start-up and connections, the issue's targets with verdicts, and the
paired rounds as medians of per-round ratios (every round's value beside them)."""

from __future__ import annotations

import statistics
from typing import Any

from bench.report.common import fmt, ratio, round_pairs, table, verdict
from bench.report.paired import median_of
from bench.report.targets import _ge, _le

ENGINE = "engine"
WORKERS = "workers"
BASE = "base"
GB = 1e9
LIBTORCH_PROCESSES = 1
"""Exactly one process of the engine system maps libtorch: the engine."""
HOLDING_PROCESSES = 2
PSS_BOUND = 0.65
WARM_START_BOUND = 0.5
RPS_BOUNDS = {"digits": 0.9, "minilm-1": 0.95}
"""The issue's floors for engine ÷ workers req/s at the headline concurrency."""


def start_ratios(starts: list[dict[str, Any]], kind: str, other: str = WORKERS) -> list[float]:
    """engine ÷ ``other`` seconds to ready, one ratio per start round in which both started."""
    by_round: dict[int, dict[str, float]] = {}
    for start in starts:
        if start["kind"] == kind:
            by_round.setdefault(start["round"], {})[start["system"]] = float(start["seconds"])
    found = (ratio(r.get(ENGINE), r.get(other)) for _, r in sorted(by_round.items()))
    return [value for value in found if value is not None]


def median_seconds(starts: list[dict[str, Any]], system: str, kind: str) -> float | None:
    values = [float(s["seconds"]) for s in starts if s["system"] == system and s["kind"] == kind]
    return statistics.median(values) if values else None


def pss_ratio(record: dict[str, Any], key: str, other: str = WORKERS) -> float | None:
    """engine ÷ ``other`` process-group PSS at one moment (``memory_warm``,
    ``memory_after_rounds``)."""
    memory = record.get(key) or {}
    if ENGINE not in memory or other not in memory:
        return None
    return ratio(memory[ENGINE]["pss_bytes"], memory[other]["pss_bytes"])


def rps_ratios(
    record: dict[str, Any], workload: str, concurrency: int, other: str = WORKERS
) -> list[float]:
    """engine ÷ ``other`` req/s, one ratio per paired round."""
    pairs = round_pairs(record.get("runs", []), ENGINE, other).get((workload, concurrency), [])
    found = (ratio(p[ENGINE]["rps"], p[other]["rps"]) for p in pairs)
    return [value for value in found if value is not None]


def _gb(memory: dict[str, Any] | None) -> float | None:
    return None if not memory else memory["pss_bytes"] / GB


def _held(connections: dict[str, Any] | None) -> str:
    if not connections:
        return "–"
    held = ", ".join(f"{role} {n}" for role, n in connections["by_process"].items() if n)
    return f"{held or 'none'} ({connections['answered']}/{connections['connections']} answered)"


def systems_of(record: dict[str, Any]) -> list[str]:
    """The systems the phase measured, the base revision's workers last when it ran."""
    return list(record.get("systems") or (WORKERS, ENGINE))


def baselines(record: dict[str, Any]) -> list[str]:
    """What the engine system is compared with: the base revision's workers first (the process
    model before the engine process, the issue's baseline) when measured, this checkout's."""
    return [BASE, WORKERS] if BASE in systems_of(record) else [WORKERS]


def engines_line(record: dict[str, Any]) -> str:
    """What each model served on in each system, as its log's model table said."""
    parts = []
    for system in systems_of(record):
        models = record.get("processes", {}).get(system, {}).get("models") or {}
        shown = ", ".join(f"{m} {v['engine']} ({v['limit']})" for m, v in models.items())
        parts.append(f"{system}: {shown or '–'}")
    return "; ".join(parts)


def system_rows(record: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Per system: processes, those mapping libtorch, PSS warm and after the rounds, the median
    cold and warm start, and the processes holding the connections."""
    rows = []
    starts = record.get("start_ups", [])
    for system in systems_of(record):
        census = record.get("processes", {}).get(system)
        rows.append(
            (
                system,
                len(census["processes"]) if census else None,
                ", ".join(p["role"] for p in census["processes"] if p["libtorch"])
                if census
                else None,
                _gb(record.get("memory_warm", {}).get(system)),
                _gb(record.get("memory_after_rounds", {}).get(system)),
                median_seconds(starts, system, "cold"),
                median_seconds(starts, system, "warm"),
                _held(record.get("connections", {}).get(system)),
            )
        )
    return rows


def target_rows(record: dict[str, Any], concurrency: int) -> list[tuple[str, str, str, str]]:
    """The issue's "Done when" figures for this machine: value, target, verdict."""
    rows: list[tuple[str, str, str, str]] = []
    census = record.get("processes", {}).get(ENGINE)
    libtorch = None if census is None else int(census["libtorch"])
    rows.append(
        (
            "engine system: processes mapping libtorch",
            fmt(libtorch),
            f"exactly {LIBTORCH_PROCESSES}",
            verdict(None if libtorch is None else libtorch == LIBTORCH_PROCESSES),
        )
    )
    held = record.get("connections", {}).get(ENGINE)
    holding = None if held is None else int(held["holding"])
    rows.append(
        (
            f"engine system: processes holding {concurrency} connections",
            fmt(holding),
            f"≥ {HOLDING_PROCESSES}",
            verdict(None if holding is None else holding >= HOLDING_PROCESSES),
        )
    )
    for other in baselines(record):
        rows += _ratio_rows(record, concurrency, other)
    return rows


def _ratio_rows(
    record: dict[str, Any], concurrency: int, other: str
) -> list[tuple[str, str, str, str]]:
    """The ratio targets against ``other``: memory, start-up and req/s."""
    rows: list[tuple[str, str, str, str]] = []
    for key, label in (("memory_warm", "warm"), ("memory_after_rounds", "after the rounds")):
        value = pss_ratio(record, key, other)
        rows.append(
            (
                f"process group PSS engine ÷ {other} ({label})",
                f"{fmt(value, 2)}×",
                f"≤ {PSS_BOUND}×",
                verdict(_le(value, PSS_BOUND)),
            )
        )
    starts = record.get("start_ups", [])
    for kind, bound in (("warm", WARM_START_BOUND), ("cold", None)):
        value, shown = median_of(start_ratios(starts, kind, other), "×")
        rows.append(
            (
                f"{kind} start to ready engine ÷ {other}",
                shown,
                "–" if bound is None else f"≤ {bound}×",
                "–" if bound is None else verdict(_le(value, bound)),
            )
        )
    for workload, bound in RPS_BOUNDS.items():
        value, shown = median_of(rps_ratios(record, workload, concurrency, other), "×")
        rows.append(
            (
                f"{workload} c={concurrency} req/s engine ÷ {other}",
                shown,
                f"≥ {bound}×",
                verdict(_ge(value, bound)),
            )
        )
    return rows


def round_rows(record: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Per baseline, workload and concurrency: rounds, median req/s of the engine system and of
    the baseline, engine ÷ baseline req/s per round and its median, median p99 of each and the
    p99 ratio, failed requests of each."""
    rows = []
    for other in baselines(record):
        for (workload, concurrency), pairs in round_pairs(
            record.get("runs", []), ENGINE, other
        ).items():
            p99 = [ratio(p[ENGINE]["p99_ms"], p[other]["p99_ms"]) for p in pairs]
            rows.append(
                (
                    other,
                    workload,
                    concurrency,
                    len(pairs),
                    statistics.median(p[ENGINE]["rps"] for p in pairs),
                    statistics.median(p[other]["rps"] for p in pairs),
                    median_of(rps_ratios(record, workload, concurrency, other), "×")[1],
                    statistics.median(p[ENGINE]["p99_ms"] for p in pairs),
                    statistics.median(p[other]["p99_ms"] for p in pairs),
                    median_of([v for v in p99 if v is not None], "×")[1],
                    " / ".join(
                        str(sum(int(p[s]["errors"]) for p in pairs)) for s in (ENGINE, other)
                    ),
                )
            )
    return rows


def start_rows(record: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Every timed start: seconds to ready, the other processes' CPU meanwhile, and each
    process's own time to ready from the supervisor's log."""
    return [
        (
            s["round"],
            s["system"],
            s["kind"],
            s["seconds"],
            fmt(s["foreign_cpu_cores"], 2),
            ", ".join(f"{name} {fmt(t)} s" for name, t in s["ready_after"].items()) or "–",
        )
        for s in record.get("start_ups", [])
    ]


def processes_section(results: dict[str, Any], tag: str) -> list[str]:
    record = results.get("processes")
    if not record:
        return []
    c = results["meta"]["plan"]["concurrency"]
    out = [f"## Engine process and fronts against workers ({tag})", ""]
    checks = record.get("check") or {}
    agreed = ", ".join(f"{n} {k['same']}/{k['requests']}" for n, k in checks.items())
    out.append(
        "This checkout's nograd on the shipped models, as `NOGRAD_FRONTS="
        f"{record.get('fronts', '–')}` (`engine`: one engine process, the fronts hold the HTTP "
        f"connections) and as `NOGRAD_WORKERS={record.get('workers', '–')}` (`workers`: each "
        "holds every model). Start-up: each system alone, from a fresh engine cache (cold) and "
        "again on it (warm), process start to the first 200 from `/v2/health/ready`. PSS: the "
        "supervisor and every process below it, summed. Connections: "
        f"{c} keep-alive connections, one request each, counted per process while open. Then "
        f"both up together: answers agreeing {agreed or '–'}; paired rounds (wrk, the other "
        "server paused, order reversed each round); ratios are medians of per-round ratios, "
        "every round's value in brackets."
    )
    if BASE in systems_of(record):
        out.append(
            f"`base`: the workers (`NOGRAD_WORKERS={record.get('workers', '–')}`) of revision "
            f"`{record.get('base', '–')}` ({str(record.get('base_commit', '–'))[:12]}), the "
            "process model before the engine process, on that revision's own shipped models and "
            "engine cache, in every step beside the other two; the targets are stated against it "
            "first, then against this checkout's workers."
        )
    if record.get("base_refused"):
        out.append(f"No rounds against the base: {record['base_refused']}")
    out.append("")
    if record.get("shared_cache"):
        out.append(
            f"Both up together on the engine cache the {record['shared_cache']} system's starts "
            f"wrote, so both serve each model on the same engines: {engines_line(record)}."
        )
        out.append("")
    if record.get("refused"):
        out += [f"Not measured: {record['refused']}", ""]
    header: tuple[str, ...] = (
        "system",
        "processes",
        "map libtorch",
        "PSS warm GB",
        "PSS after rounds GB",
        "cold start s",
        "warm start s",
        f"holding {c} connections",
    )
    out += [table(header, system_rows(record)), ""]
    out += [table(("figure", "value", "target", "verdict"), target_rows(record, c)), ""]
    rounds = round_rows(record)
    if rounds:
        header = (
            "against",
            "workload",
            "concurrency",
            "rounds",
            "req/s engine",
            "req/s against",
            "req/s engine ÷ against",
            "p99 ms engine",
            "p99 ms against",
            "p99 engine ÷ against",
            "failed engine / against",
        )
        out += [table(header, rounds), ""]
    starts = start_rows(record)
    if starts:
        header = ("round", "system", "start", "s to ready", "foreign CPU", "each process ready")
        out += [table(header, starts), ""]
    return out
