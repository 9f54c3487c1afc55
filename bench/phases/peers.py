"""The peers users pick instead: real Triton (through PyTriton), TorchServe and infinity (torch
and ONNX engines), each in its own pinned venv, their answers checked against nograd's, a few
batching configurations each, then the best of each paired with nograd round after round."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from bench.common import AS_SHIPPED, ROOT, Server, nograd_server, run_only
from bench.peers.check import Reference, check_workload
from bench.peers.envs import ensure_env
from bench.peers.servers import (
    ENV_OF_SYSTEM,
    MODELS_OF_SYSTEM,
    SWEEPS,
    PeerOptions,
    describe,
    peer_server,
)
from bench.phases.single import ceiling_server
from bench.session import MODEL_OF, Bench

NOGRAD = "nograd"
"""nograd as ``make run`` starts it: the shipped repository, the processes the defaults plan."""

CEILING = "http-ceiling"
PEER_READY_TIMEOUT_S = 300.0
"""Triton and TorchServe start a JVM or a server binary and load torch: minutes on 2 cores."""


def phase_peers(bench: Bench) -> None:
    """Set-up, answer checks and a sweep per peer, then paired rounds against nograd."""
    envs = _envs(bench)
    sweep, checks, refused = _sweep(bench, envs)
    best = _best(sweep)
    bench.results["peers"] = {
        "envs": envs,
        "checks": checks,
        "refused": refused,
        "sweep": sweep,
        "best": {f"{system}:{name}": row for (system, name), row in best.items()},
        "runs": [],
    }
    bench.results["peers"]["runs"] = _paired(bench, envs, best)


def _envs(bench: Bench) -> dict[str, dict[str, Any]]:
    """Each peer's venv, built on first use; a peer that cannot run keeps its reason."""
    envs: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(ENV_OF_SYSTEM.values()):
        bench.step(f"peers: set up {name}")
        env = ensure_env(name)
        envs[name] = {
            "ok": env.ok,
            "python": str(env.python) if env.python else None,
            "reason": env.reason,
            "installed_now": env.installed_now,
            "seconds": round(env.seconds, 1),
        }
        if not env.ok:
            bench.note(f"peer {name} cannot run: {env.reason}")
    return envs


def _systems(bench: Bench, envs: dict[str, dict[str, Any]]) -> list[tuple[str, str, list[str]]]:
    """(system, model, workloads) for every peer system that can run a model of the plan."""
    out = []
    for system, models in MODELS_OF_SYSTEM.items():
        if not envs[ENV_OF_SYSTEM[system]]["ok"]:
            continue
        for model in models:
            names = [n for n in bench.plan.workloads if MODEL_OF[n] == model]
            if names:
                out.append((system, model, names))
    return out


def start_peer(bench: Bench, server: Server) -> str | None:
    """Start ``server``; the reason when it cannot (the log's tail), None when it is up."""
    try:
        server.start(ready_timeout_s=PEER_READY_TIMEOUT_S)
    except (RuntimeError, OSError) as exc:
        server.stop()
        reason = f"{server.name} did not start: {str(exc)[-400:]}"
        bench.note(reason)
        return reason
    return None


def _sweep(
    bench: Bench, envs: dict[str, dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Every configuration of each peer (the first only with ``--quick``) at the headline
    concurrency, after its answers passed the check; a configuration that fails the check or
    does not start is refused with the reason and measured no further."""
    reference = Reference()
    sweep: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    for system, model, names in _systems(bench, envs):
        python = envs[ENV_OF_SYSTEM[system]]["python"]
        configurations = SWEEPS[system][:1] if bench.plan.quick else SWEEPS[system]
        for options in configurations:
            server = peer_server(system, Path(python), model, options, bench.plan.server_cpus)
            server.peer = system
            bench.step(f"peers: {system} {model} {options.label}")
            where = {"system": system, "model": model, "options": describe(options)}
            reason = start_peer(bench, server)
            if reason is not None:
                refused.append(where | {"reason": reason})
                continue
            try:
                results = [check_workload(server.url, system, n, reference) for n in names]
                checks += [where | result.as_dict() for result in results]
                failed = [r for r in results if not r.passed]
                if failed:
                    reason = "; ".join(f"{r.workload}: {r.detail}" for r in failed)
                    refused.append(where | {"reason": f"answers differ from nograd's: {reason}"})
                    bench.note(f"{server.name}: answers differ from nograd's: {reason}"[:300])
                    continue
                for name in names:
                    bench.warm(server, name)
                    result = bench.load(
                        server, system, name, duration_s=bench.plan.sweep_s, keep=False
                    )
                    if result is not None:
                        sweep.append(where | {"label": options.label} | result.as_dict())
            finally:
                server.stop()
    return sweep, checks, refused


def _best(sweep: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (system, workload), the configuration with the most answered requests per second
    (fewer failures first: a configuration that shed or failed requests is not its best)."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for row in sweep:
        key = (row["system"], row["workload"])
        score = (row["errors"] == 0, row["rps"])
        if key not in best or score > (best[key]["errors"] == 0, best[key]["rps"]):
            best[key] = row
    return best


def options_of(system: str, described: dict[str, Any]) -> PeerOptions:
    """The options object back from its description in the sweep's rows."""
    for options in SWEEPS[system]:
        if describe(options) == described:
            return options
    raise ValueError(f"{system}: no sweep configuration {described}")


def _paired(
    bench: Bench,
    envs: dict[str, dict[str, Any]],
    best: dict[tuple[str, str], dict[str, Any]],
) -> list[dict[str, Any]]:
    """nograd, the HTTP ceiling (digits) and each peer system at its best configuration per
    workload, all started once, measured in turn with the others paused (SIGSTOP), the order
    reversed every round, at the headline concurrency and at 1."""
    concurrencies = sorted({bench.plan.concurrency, 1}, reverse=True)
    with contextlib.ExitStack() as stack:
        bench.step("peers: start nograd")
        nograd = stack.enter_context(
            nograd_server(ROOT / "models", bench.plan.server_cpus, AS_SHIPPED)
        )
        everyone: list[Server] = [nograd]
        lineup: dict[str, list[tuple[str, Server]]] = {
            n: [(NOGRAD, nograd)] for n in bench.plan.workloads
        }
        if "digits" in bench.plan.workloads:
            bench.step("peers: start the HTTP ceiling")
            ceiling = stack.enter_context(ceiling_server(bench))
            everyone.append(ceiling)
            lineup["digits"].append((CEILING, ceiling))
        started: dict[tuple[str, str, str], Server] = {}
        for (system, name), row in sorted(best.items()):
            python = envs[ENV_OF_SYSTEM[system]]["python"]
            options = options_of(system, row["options"])
            key = (system, MODEL_OF[name], options.label)
            if key not in started:
                server = peer_server(
                    system, Path(python), MODEL_OF[name], options, bench.plan.server_cpus
                )
                server.peer = system
                bench.step(f"peers: start {server.name}")
                reason = start_peer(bench, server)
                if reason is not None:
                    bench.results["peers"]["refused"].append(
                        {"system": system, "model": MODEL_OF[name], "options": row["options"]}
                        | {"reason": f"paired rounds: {reason}"}
                    )
                    continue
                stack.callback(server.stop)
                started[key] = server
                everyone.append(server)
            lineup[name].append((system, started[key]))
        runs = measure_rounds(bench, lineup, everyone, concurrencies, "peers")
    return runs


def measure_rounds(
    bench: Bench,
    lineup: dict[str, list[tuple[str, Server]]],
    everyone: list[Server],
    concurrencies: list[int],
    phase: str,
) -> list[dict[str, Any]]:
    """Per round, workload and concurrency, each system of the workload's ``lineup`` measured in
    turn with every other server of ``everyone`` paused (SIGSTOP), the order reversed every round;
    the headline duration at the plan's concurrency, the short one elsewhere. Every server is
    resumed at the end."""
    runs: list[dict[str, Any]] = []
    for index in range(bench.plan.paired_rounds):
        for name, systems in lineup.items():
            for concurrency in concurrencies:
                order = systems if index % 2 == 0 else systems[::-1]
                for position, (system, server) in enumerate(order):
                    run_only(server, everyone)
                    bench.warm(server, name, concurrency=concurrency)
                    bench.step(f"{phase} round {index + 1}: {system} {name} c={concurrency}")
                    result = bench.load(
                        server,
                        system,
                        name,
                        concurrency=concurrency,
                        duration_s=bench.plan.duration_s
                        if concurrency == bench.plan.concurrency
                        else bench.plan.short_s,
                        nograd_metrics=system == NOGRAD,
                        keep=False,
                    )
                    if result is not None:
                        runs.append({"round": index + 1, "position": position} | result.as_dict())
    for server in everyone:
        server.resume()
    return runs
