"""Report sections of the per-phase runs: the header, targets, closed and open loops."""

from __future__ import annotations

import math
from typing import Any

from bench.report.common import (
    LABELS,
    NOISY_CORES,
    SYSTEM_ORDER,
    cpu_us,
    default_processes,
    default_system,
    fmt,
    head,
    litserve_best,
    noise,
    ratio,
    runs,
    table,
)
from bench.report.sections import workloads_model
from bench.report.targets import raw_limit, targets


def header_section(results: dict[str, Any]) -> list[str]:
    """The machine, the command, the noise seen, and whether the code changed during the run."""
    meta = results["meta"]
    cores = meta["cores"]
    plan = meta["plan"]
    dirty = " + uncommitted nograd/models changes" if meta["git"]["code_dirty"] else ""
    minutes = fmt(meta.get("elapsed_s", 0) / 60, 1)
    pin = "server on core 0, load generator on core 1" if plan["server_cpus"] else "no pinning"
    parts = [
        f"# nograd benchmark, {meta['started']}",
        "",
        f"Machine: **{cores} cores** ({meta['cpu']}), torch {meta['torch']} "
        f"({meta['torch_threads']} intra-op threads), Python {meta['python']}; {pin}. "
        f"git {meta['git']['commit']}{dirty}. "
        f"Load average at start {fmt(meta['loadavg_at_start'][0], 2)}, at end "
        f"{fmt(meta.get('loadavg_at_end', [math.nan])[0], 2)}; whole run {minutes} min.",
        "",
        f"Command: `{meta['command']}`",
        "",
    ]
    if "auto_workers" in meta:
        same = default_system(meta)
        reason = meta.get("default_fronts_reason") or meta["auto_workers_reason"]
        parts += [
            f"nograd's defaults (`make run`) start **{default_processes(meta)}** on this machine "
            f"({reason}): "
            + (f"the rows labelled “{LABELS[same]}”." if same else "not a system measured here.")
            + " Every nograd system sets its processes explicitly (`NOGRAD_WORKERS`, "
            "`NOGRAD_FRONTS`), except where a section says it runs as shipped.",
            "",
        ]
    foreign = [r["extra"].get("foreign_cpu_cores", 0.0) for r in results.get("runs", [])]
    if foreign:
        noisy = sum(1 for f in foreign if f > NOISY_CORES)
        parts += [
            f"Other processes on the machine used {fmt(sum(foreign) / len(foreign), 2)} cores on "
            f"average during the kept runs (max {fmt(max(foreign), 2)}); "
            f"{meta.get('noisy_retries', 0)} runs were repeated because other processes "
            f"disturbed them, and {noisy} of {len(foreign)} kept runs still saw more than "
            f"{NOISY_CORES} cores of other work (marked † below). On 2 cores such noise slows a "
            "forward with 2 torch threads many-fold, so † numbers understate that system.",
            "",
        ]
    hashes = sorted(
        {r["extra"]["code_hash"] for r in results.get("runs", []) if "code_hash" in r["extra"]}
    )
    if len(hashes) > 1:
        parts += [
            f"**The work tree changed during this run** (nograd code digests {', '.join(hashes)}):"
            " nograd rows measured with different code are not comparable.",
            "",
        ]
    elif hashes:
        parts += [f"code digest (nograd/, models/): {hashes[0]}, the same for every run.", ""]
    if results.get("failures"):
        parts += [
            "**Failed phases:** "
            + "; ".join(f"{k}: {v[:200]}" for k, v in results["failures"].items()),
            "",
        ]
    return parts


def targets_section(results: dict[str, Any]) -> list[str]:
    """The issue's targets from each phase's own runs."""
    plan = results["meta"]["plan"]
    c = plan["concurrency"]
    tag = f"{results['meta']['cores']} cores"
    rows = targets(results)
    if not rows:
        return []  # no phase of this run measured them (a run of other phases only)
    parts: list[str] = []
    parts += [f"## Targets (issue 5), ratios from this run's phases ({tag}, concurrency {c})", ""]
    parts.append(table(("target", "measured", "target", "verdict"), rows))
    parts.append("")
    more = targets(results, "nograd-workers-2")
    if more:
        parts += [f"### The same targets for {LABELS['nograd-workers-2']} ({tag})", ""]
        parts += [table(("target", "measured", "target", "verdict"), more), ""]

    return parts


def closed_loop_section(results: dict[str, Any]) -> list[str]:
    """One table per workload of the headline closed-loop runs."""
    plan = results["meta"]["plan"]
    c = plan["concurrency"]
    tag = f"{results['meta']['cores']} cores"
    parts: list[str] = []
    for workload in plan["workloads"]:
        rows = []
        for system in SYSTEM_ORDER:
            r = head(results, system, workload)
            if r is None:
                continue
            note = ""
            if system == "litserve":
                extra = r["extra"]
                note = (
                    f"max_batch_size {extra.get('max_batch_size')}, "
                    f"batch_timeout {extra.get('batch_timeout')}"
                )
            if "mean_batch_size" in r["extra"]:
                note = f"mean batch {fmt(r['extra']['mean_batch_size'], 1)}"
            if r["extra"].get("foreign_cpu_cores", 0.0) > NOISY_CORES:
                note = f"† {note}"
            rows.append(
                (
                    LABELS.get(system, system),
                    r["rps"],
                    r["samples_per_s"],
                    r["p50_ms"],
                    r["p90_ms"],
                    r["p99_ms"],
                    r["p999_ms"],
                    r["errors"],
                    r["extra"].get("server_cpu_cores"),
                    cpu_us(r),
                    r["extra"].get("foreign_cpu_cores"),
                    note,
                )
            )
        if not rows:
            continue
        parts += [
            f"### {workload} ({tag}, c={c}, wrk)",
            "",
            table(
                (
                    "system",
                    "req/s",
                    "samples/s",
                    "p50 ms",
                    "p90 ms",
                    "p99 ms",
                    "p99.9 ms",
                    "errors",
                    "server CPU (cores)",
                    "server CPU µs/req",
                    "foreign CPU (cores)",
                    "notes",
                ),
                rows,
            ),
            "",
        ]
    if not parts:
        return []  # no closed-loop run of the headline systems in this run
    return [f"## Closed loop, concurrency {c} ({tag})", "", *parts]


def ratios_section(results: dict[str, Any]) -> list[str]:
    """nograd's throughput against every other system, per workload."""
    plan = results["meta"]["plan"]
    c = plan["concurrency"]
    tag = f"{results['meta']['cores']} cores"
    parts: list[str] = []
    ratio_rows = []
    for workload in plan["workloads"]:
        ng = head(results, "nograd", workload)
        if not ng:
            continue
        row = [workload]
        row.append(ratio(ng["samples_per_s"], raw_limit(results, workloads_model(workload))))
        for system in ("fastapi", "litserve", "http-ceiling"):
            other = head(results, system, workload)
            best = other["samples_per_s"] if other else None
            if system == "litserve":
                found = litserve_best(results, workload)
                best = found[0] if found else None
            row.append(ratio(ng["samples_per_s"], best))
        ratio_rows.append(row)
    if not ratio_rows:
        return []
    parts += [
        f"### nograd throughput ratios ({tag}, c={c})",
        "",
        table(
            (
                "workload",
                "vs raw best",
                "vs FastAPI",
                "vs LitServe best (sweep included)",
                "vs HTTP ceiling",
            ),
            ratio_rows,
        ),
        "",
    ]

    return parts


def every_run_section(results: dict[str, Any]) -> list[str]:
    """Every closed-loop run, at every concurrency."""
    plan = results["meta"]["plan"]
    tag = f"{results['meta']['cores']} cores"
    parts: list[str] = []
    sweep_rows = []
    for workload in plan["workloads"]:
        for system in SYSTEM_ORDER:
            for r in sorted(
                runs(results, system=system, workload=workload, mode="closed"),
                key=lambda r: r["concurrency"],
            ):
                sweep_rows.append(
                    (
                        workload,
                        LABELS.get(system, system),
                        r["concurrency"],
                        r["rps"],
                        r["samples_per_s"],
                        r["p50_ms"],
                        r["p99_ms"],
                        r["errors"],
                        noise(r),
                    )
                )
    if not sweep_rows:
        return []
    parts += [
        f"## Every closed-loop run ({tag})",
        "",
        table(
            (
                "workload",
                "system",
                "concurrency",
                "req/s",
                "samples/s",
                "p50 ms",
                "p99 ms",
                "errors",
                "foreign CPU",
            ),
            sweep_rows,
        ),
        "",
    ]
    return parts


def open_loop_section(results: dict[str, Any]) -> list[str]:
    """Fixed arrival rates (Poisson): latency from the scheduled send time."""
    plan = results["meta"]["plan"]
    tag = f"{results['meta']['cores']} cores"
    parts: list[str] = []
    open_rows = []
    for workload in plan["workloads"]:
        for system in SYSTEM_ORDER:
            for r in runs(results, system=system, workload=workload, mode="open"):
                open_rows.append(
                    (
                        workload,
                        LABELS.get(system, system),
                        r["rate"],
                        r["rps"],
                        r["p50_ms"],
                        r["p99_ms"],
                        r["p999_ms"],
                        r["errors"],
                        r["generator_cpu_share"],
                        noise(r),
                    )
                )
    if open_rows:
        parts += [
            f"## Open loop: fixed arrival rate, Poisson ({tag})",
            "",
            "Rates are fractions of nograd's closed-loop throughput, the same for every system. "
            "Latency counts from each request's scheduled send time. The generator is Python "
            "(asyncio + aiohttp) in its own process; its CPU share (of one core) is shown.",
            "",
            table(
                (
                    "workload",
                    "system",
                    "offered req/s",
                    "answered req/s",
                    "p50 ms",
                    "p99 ms",
                    "p99.9 ms",
                    "errors",
                    "generator CPU",
                    "foreign CPU",
                ),
                open_rows,
            ),
            "",
        ]
    return parts
