"""The Markdown report of one run, section by section."""

from __future__ import annotations

from typing import Any

from bench.report.archives import archives_section
from bench.report.engines import engines_section
from bench.report.fleet import fleet_section
from bench.report.levers import levers_section
from bench.report.memory import memory_section
from bench.report.over_grpc import grpc_section
from bench.report.paired import paired_section
from bench.report.peers import peers_section
from bench.report.processes import processes_section
from bench.report.profile import profile_section
from bench.report.residency import residency_section
from bench.report.revisions import revisions_section
from bench.report.runs import (
    closed_loop_section,
    every_run_section,
    header_section,
    open_loop_section,
    ratios_section,
    targets_section,
)
from bench.report.sections import batching_section, raw_section, sweep_section


def markdown(results: dict[str, Any]) -> str:
    """The whole report: nograd against the real peers first, then the same TorchServe archive
    served by both, then gRPC against HTTP and
    Triton's gRPC, then the paired verdicts, then every phase's tables."""
    plan = results["meta"]["plan"]
    c = plan["concurrency"]
    tag = f"{results['meta']['cores']} cores"
    parts = header_section(results)
    parts += revisions_section(results, tag)
    parts += processes_section(results, tag)
    parts += peers_section(results, tag)
    parts += archives_section(results, tag)
    parts += residency_section(results, tag)
    parts += fleet_section(results, tag)
    parts += grpc_section(results, tag)
    parts += paired_section(results, tag)
    parts += engines_section(results, tag)
    parts += targets_section(results)
    parts += closed_loop_section(results)
    parts += ratios_section(results)
    parts += every_run_section(results)
    parts += open_loop_section(results)
    for key, title in (
        ("litserve_sweep", "LitServe configurations"),
        ("litserve_packed_sweep", "LitServe configurations, nograd's packed minilm forward"),
    ):
        parts += sweep_section(results.get(key, []), f"{title} ({tag}, c={c})")
    parts += raw_section(results, tag)
    parts += batching_section(results, tag)
    parts += levers_section(results, tag)
    parts += memory_section(results, tag)
    parts += profile_section(results, tag)
    return "\n".join(parts) + "\n"
