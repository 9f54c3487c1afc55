"""gRPC against HTTP on the same nograd, and nograd's gRPC against Triton's, every run driven by
Triton's perf_analyzer: the client Triton users trust, the same client on both protocols."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from bench import perf_analyzer
from bench.common import ROOT, Server, nograd_server, run_only
from bench.peers.check import Reference, check_workload
from bench.peers.envs import PeerEnv, ensure_env
from bench.peers.servers import TritonOptions, describe, pytriton_server
from bench.phases.peers import options_of, start_peer
from bench.session import MODEL_OF, WORKERS_2, Bench, wait_workers

NOGRAD = "nograd"
NOGRAD_WORKERS_2 = "nograd-workers-2"
PYTRITON = "pytriton"
Entry = tuple[str, Server, str]
"""(system, server, protocol) of one run in a round."""


def phase_grpc(bench: Bench) -> None:
    """Paired rounds with perf_analyzer on every run: nograd as one process and as two workers
    (what ``auto`` starts on two cores), each over HTTP and over gRPC, and Triton through
    PyTriton over gRPC, at the headline concurrency and at 1.

    Every nograd server stays up for the phase; PyTriton serves one model at a time, started
    for its workload's rounds and checked against nograd's answers first. Within a round each
    server's HTTP and gRPC runs are adjacent and the order is reversed every round, so
    each protocol goes first in half the rounds; the servers not under load are paused
    (SIGSTOP; Triton cannot be and idles). perf_analyzer sends one sample per request, so the
    phase runs the plan's one-sample workloads (digits, minilm-1) and notes the others.
    """
    names = [n for n in bench.plan.workloads if bench.workload(n).samples_per_request == 1]
    skipped = [n for n in bench.plan.workloads if n not in names]
    if skipped:
        bench.note(f"grpc: perf_analyzer sends one sample per request; skipping {skipped}")
    found: dict[str, Any] = {"tool": perf_analyzer.tool(), "skipped": skipped, "runs": []}
    bench.results["grpc"] = found
    cpus = bench.plan.server_cpus
    with contextlib.ExitStack() as stack:
        bench.step("grpc: start nograd")
        one = stack.enter_context(nograd_server(ROOT / "models", cpus))
        bench.step("grpc: start nograd-workers-2")
        two = stack.enter_context(nograd_server(ROOT / "models", cpus, WORKERS_2))
        wait_workers(two, 2)
        bench.step("grpc: set up pytriton")
        env = ensure_env(PYTRITON)
        found[PYTRITON] = {"env_reason": env.reason, "checks": [], "refused": []}
        if not env.ok:
            bench.note(f"grpc: PyTriton cannot run: {env.reason}")
        for name in names:
            lineup: list[Entry] = [
                (system, server, protocol)
                for system, server in ((NOGRAD, one), (NOGRAD_WORKERS_2, two))
                for protocol in perf_analyzer.PROTOCOLS
            ]
            with contextlib.ExitStack() as peer:
                everyone = [one, two]
                triton = _pytriton(bench, env, name, peer, found[PYTRITON])
                if triton is not None:
                    lineup.append((PYTRITON, triton, "grpc"))
                    everyone.append(triton)
                found["runs"] += _rounds(bench, name, lineup, everyone)
                for server in everyone:
                    server.resume()


def _pytriton(
    bench: Bench, env: PeerEnv, name: str, stack: contextlib.ExitStack, found: dict[str, Any]
) -> Server | None:
    """Triton through PyTriton serving ``name``'s model, at the configuration the peers phase
    found best in this run (else its first), once its answers match nograd's; None, with the
    reason recorded, when it cannot run, start or answer alike."""
    if not env.ok or env.python is None:
        return None
    best = bench.results.get("peers", {}).get("best", {}).get(f"{PYTRITON}:{name}")
    options = options_of(PYTRITON, best["options"]) if best else TritonOptions()
    assert isinstance(options, TritonOptions)
    model = MODEL_OF[name]
    server = pytriton_server(Path(env.python), model, options, bench.plan.server_cpus)
    server.peer = PYTRITON
    bench.step(f"grpc: start {server.name}")
    where = {"model": model, "workload": name, "options": describe(options)}
    reason = start_peer(bench, server)
    if reason is not None:
        found["refused"].append(where | {"reason": reason})
        return None
    stack.callback(server.stop)
    check = check_workload(server.url, PYTRITON, name, Reference())
    found["checks"].append(where | check.as_dict())
    if not check.passed:
        found["refused"].append(where | {"reason": f"answers differ: {check.detail}"})
        bench.note(f"grpc: {server.name}'s answers differ from nograd's: {check.detail}"[:300])
        return None
    return server


def _rounds(
    bench: Bench, name: str, lineup: list[Entry], everyone: list[Server]
) -> list[dict[str, Any]]:
    """The plan's rounds of ``lineup`` on one workload, at the headline concurrency (headline
    duration) and at 1 (the short one), each run after a warm-up at its own concurrency over
    its own protocol."""
    plan = bench.plan
    runs: list[dict[str, Any]] = []
    for index in range(plan.paired_rounds):
        for concurrency in sorted({plan.concurrency, 1}, reverse=True):
            order = lineup if index % 2 == 0 else lineup[::-1]
            duration_s = plan.duration_s if concurrency == plan.concurrency else plan.short_s
            for position, (system, server, protocol) in enumerate(order):
                run_only(server, everyone)
                bench.warm(server, name, concurrency=concurrency, perf_analyzer=protocol)
                bench.step(f"grpc round {index + 1}: {system} {protocol} {name} c={concurrency}")
                result = bench.load(
                    server,
                    system,
                    name,
                    concurrency=concurrency,
                    duration_s=duration_s,
                    nograd_metrics=system != PYTRITON,
                    keep=False,
                    perf_analyzer=protocol,
                )
                if result is not None:
                    where = {"round": index + 1, "position": position, "protocol": protocol}
                    runs.append(where | result.as_dict())
    return runs
