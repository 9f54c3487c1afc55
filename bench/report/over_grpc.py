"""The gRPC section: nograd over gRPC against the same server over HTTP, and against Triton's gRPC
(PyTriton), every run by perf_analyzer; per-round ratios, their medians and the targets."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from bench.report.common import LABELS, cpu_us, default_system, fmt, noise, table, verdict
from bench.report.paired import median_of
from bench.report.targets import _ge, _le

NOGRAD_SYSTEMS = ("nograd", "nograd-workers-2")
PYTRITON = "pytriton"
WORKLOADS = ("digits", "minilm-1")
Side = tuple[str, str]
"""(system, protocol): one series of runs in the rounds."""


def _rps(run: dict[str, Any]) -> float:
    return float(run["rps"])


def _p99(run: dict[str, Any]) -> float:
    return float(run["p99_ms"])


Value = Callable[[dict[str, Any]], float | None]
TARGETS: tuple[tuple[str, str, str, Value, float, bool], ...] = (
    ("digits", "gRPC throughput ÷ HTTP's", "http", _rps, 0.8, True),
    ("digits", "gRPC p99 ÷ HTTP's", "http", _p99, 1.5, False),
    ("minilm-1", "gRPC throughput ÷ HTTP's", "http", _rps, 0.9, True),
    ("digits", "gRPC throughput ÷ PyTriton's gRPC", PYTRITON, _rps, 1.5, True),
)
"""(workload, what, against (the same server over HTTP, or PyTriton over gRPC), value, bound,
at least), at the headline concurrency: the issue's targets for the front."""


def by_round(
    results: dict[str, Any], workload: str, concurrency: int, side: Side
) -> dict[int, dict[str, Any]]:
    """One system's runs over one protocol, by round."""
    system, protocol = side
    return {
        run["round"]: run
        for run in results.get("grpc", {}).get("runs", [])
        if (run["workload"], run["concurrency"], run["system"], run["protocol"])
        == (workload, concurrency, system, protocol)
    }


def paired(
    results: dict[str, Any], workload: str, concurrency: int, mine: Side, theirs: Side
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The two sides' runs of the rounds that measured both, in round order."""
    first = by_round(results, workload, concurrency, mine)
    second = by_round(results, workload, concurrency, theirs)
    common = sorted(first.keys() & second.keys())
    return [first[i] for i in common], [second[i] for i in common]


def ratios(
    results: dict[str, Any],
    workload: str,
    concurrency: int,
    mine: Side,
    theirs: Side,
    value: Value,
) -> list[float]:
    """``value`` of ``mine`` over ``theirs``, one ratio per round that measured both."""
    out = []
    for a, b in zip(*paired(results, workload, concurrency, mine, theirs), strict=True):
        top, bottom = value(a), value(b)
        if top is not None and bottom:
            out.append(top / bottom)
    return out


def cpu_per_request_us(run: dict[str, Any]) -> float | None:
    """The server's CPU over its answers in the same span (nograd counts them), else over the
    client's throughput."""
    extra = run["extra"]
    if extra.get("server_answers") and extra.get("server_cpu_s") is not None:
        return float(extra["server_cpu_s"]) / float(extra["server_answers"]) * 1e6
    return cpu_us(run)


def _median(runs: list[dict[str, Any]], value: Value) -> str:
    found = [float(v) for v in (value(r) for r in runs) if v is not None]
    return fmt(statistics.median(found), 2) if found else "–"


def protocol_rows(results: dict[str, Any]) -> list[Sequence[Any]]:
    """Per workload, concurrency and nograd server: gRPC ÷ HTTP (throughput, p99, server CPU per
    request), each side's requests/s, and perf_analyzer's own CPU over each protocol."""
    rows: list[Sequence[Any]] = []
    for workload, concurrency in _cases(results):
        for system in NOGRAD_SYSTEMS:
            grpc, http = (system, "grpc"), (system, "http")
            if not ratios(results, workload, concurrency, grpc, http, _rps):
                continue
            sides = paired(results, workload, concurrency, http, grpc)
            rows.append(
                (
                    workload,
                    concurrency,
                    LABELS[system].removeprefix("nograd, "),
                    *(
                        median_of(ratios(results, workload, concurrency, grpc, http, f), "×")[1]
                        for f in (_rps, _p99, cpu_per_request_us)
                    ),
                    " / ".join(_median(runs, _rps) for runs in sides),
                    " / ".join(_median(runs, _p99) for runs in sides),
                    " / ".join(_median(runs, _generator) for runs in sides),
                )
            )
    return rows


def peer_rows(results: dict[str, Any]) -> list[Sequence[Any]]:
    """Per workload, concurrency and nograd server: its gRPC ÷ PyTriton's gRPC."""
    rows: list[Sequence[Any]] = []
    for workload, concurrency in _cases(results):
        for system in NOGRAD_SYSTEMS:
            ours, peer = (system, "grpc"), (PYTRITON, "grpc")
            if not ratios(results, workload, concurrency, ours, peer, _rps):
                continue
            rows.append(
                (
                    workload,
                    concurrency,
                    LABELS[system].removeprefix("nograd, "),
                    *(
                        median_of(ratios(results, workload, concurrency, ours, peer, f), "×")[1]
                        for f in (_rps, _p99)
                    ),
                    " / ".join(
                        _median(runs, _rps)
                        for runs in paired(results, workload, concurrency, ours, peer)
                    ),
                )
            )
    return rows


def grpc_targets(results: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(target, server, median of rounds, threshold, verdict) for every nograd server measured;
    the one ``make run`` starts on this machine is marked."""
    c = results["meta"]["plan"]["concurrency"]
    auto = default_system(results["meta"])
    rows = []
    for workload, what, other, value, bound, at_least in TARGETS:
        for system in NOGRAD_SYSTEMS:
            theirs = (PYTRITON, "grpc") if other == PYTRITON else (system, other)
            values = ratios(results, workload, c, (system, "grpc"), theirs, value)
            if not values:
                continue
            middle, shown = median_of(values, "×")
            ok = _ge(middle, bound) if at_least else _le(middle, bound)
            server = LABELS[system].removeprefix("nograd, ")
            rows.append(
                (
                    f"{workload} c={c}: {what}",
                    server + (" (the default here)" if system == auto else ""),
                    shown,
                    f"{'≥' if at_least else '≤'} {bound:g}×",
                    verdict(ok),
                )
            )
    return rows


def _cases(results: dict[str, Any]) -> list[tuple[str, int]]:
    """(workload, concurrency) pairs measured, in the report's order."""
    found = {(r["workload"], r["concurrency"]) for r in results.get("grpc", {}).get("runs", [])}
    order = {name: index for index, name in enumerate(WORKLOADS)}
    return sorted(found, key=lambda k: (order.get(k[0], len(order)), k[0], -k[1]))


def _generator(run: dict[str, Any]) -> float | None:
    share = run.get("generator_cpu_share")
    return None if share is None else float(share)


def grpc_section(results: dict[str, Any], tag: str) -> list[str]:
    data = results.get("grpc")
    if not data or not data.get("runs"):
        return []
    rounds = max(r["round"] for r in data["runs"])
    parts = [
        f"## gRPC against HTTP, and against Triton's gRPC, by perf_analyzer ({tag}, {rounds} "
        f"round{'s' if rounds != 1 else ''})",
        "",
        "Triton's perf_analyzer drives every run, over HTTP and over gRPC alike: a closed loop "
        "of synchronous calls at a fixed concurrency, three measurement windows of the same "
        "length, the workload's own samples (`--input-data`). Each nograd server (one process, "
        "and two workers) runs over both protocols next to each other in every round, the "
        "order reversed each round; Triton through PyTriton runs over gRPC in the same rounds. "
        "Ratios are per round, the median over rounds first and every round in brackets. Server "
        "CPU per request is nograd's CPU over the answers it counted in the same span.",
        "",
        "### Targets",
        "",
        table(
            ("target", "server", "median of rounds", "threshold", "verdict"),
            grpc_targets(results),
        ),
        "",
        "### gRPC ÷ HTTP, same server",
        "",
        table(
            (
                "workload",
                "c",
                "server",
                "throughput",
                "p99",
                "server CPU per request",
                "req/s, HTTP / gRPC",
                "p99 ms, HTTP / gRPC",
                "perf_analyzer cores, HTTP / gRPC",
            ),
            protocol_rows(results),
        ),
        "",
    ]
    peer = peer_rows(results)
    if peer:
        parts += [
            "### nograd's gRPC ÷ PyTriton's gRPC",
            "",
            table(
                ("workload", "c", "nograd server", "throughput", "p99", "req/s, nograd / PyTriton"),
                peer,
            ),
            "",
        ]
    parts += _pytriton_notes(data) + _every_run(data["runs"])
    return parts


def _pytriton_notes(data: dict[str, Any]) -> list[str]:
    """How PyTriton was set up, its answer checks, and why it is missing where it is."""
    found = data.get("pytriton", {})
    lines = []
    if found.get("env_reason"):
        lines.append(f"- PyTriton could not run: {found['env_reason']}")
    for check in found.get("checks", []):
        options = check["options"]
        lines.append(
            f"- PyTriton {check['workload']} (max batch {options['max_batch_size']}, queue delay "
            f"{options['max_queue_delay_us']} µs): answers "
            f"{'match' if check['passed'] else 'differ from'} nograd's "
            f"(min cosine {fmt(check['min_cosine'], 6)}, max abs diff "
            f"{fmt(check['max_abs_diff'], 6)})"
        )
    lines += [
        f"- PyTriton {r['workload']} left out: {r['reason']}" for r in found.get("refused", [])
    ]
    if data.get("skipped"):
        lines.append(f"- not run (more than one sample per request): {', '.join(data['skipped'])}")
    return [*lines, ""] if lines else []


def _every_run(runs: list[dict[str, Any]]) -> list[str]:
    rows = [
        (
            r["workload"],
            r["concurrency"],
            r["round"],
            r["system"],
            r["protocol"],
            r["rps"],
            r["p50_ms"],
            r["p99_ms"],
            fmt(cpu_per_request_us(r), 0),
            fmt(_generator(r), 2),
            fmt(r["extra"].get("mean_batch_size"), 1),
            noise(r),
        )
        for r in sorted(
            runs, key=lambda r: (r["workload"], -r["concurrency"], r["round"], r["position"])
        )
    ]
    header = (
        "workload",
        "c",
        "round",
        "system",
        "protocol",
        "req/s",
        "p50 ms",
        "p99 ms",
        "server CPU µs/request",
        "perf_analyzer cores",
        "mean batch",
        "foreign CPU",
    )
    return ["### Every run (within a round, in the order run)", "", table(header, rows), ""]
