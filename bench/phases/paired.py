"""Paired rounds: every system started once and measured in turn, round after round, the others
paused, so each round's ratios compare systems at the same machine speed."""

from __future__ import annotations

import contextlib
from typing import Any

from bench.common import ROOT, Server, nograd_server, run_only
from bench.phases.litserve import litserve
from bench.phases.single import ceiling_server
from bench.session import MODEL_OF, WORKERS_2, Bench, wait_workers


def phase_paired(bench: Bench) -> None:
    """Interleaved rounds: every system of a workload's targets measured in turn, round
    after round, all of them started once and the ones not under load paused (SIGSTOP).

    On a shared host the machine's speed can move two-fold between phases minutes apart
    (a paired batch-1 yardstick read 13.6-15.1 ms in one phase and 30.4-31.4 ms in a later
    one, with no foreign CPU in the guest), so a ratio of two phases can be a ratio of two
    machine speeds. Here nograd (one process and two workers), LitServe at the best
    configuration its sweep found, the HTTP ceiling (digits; one process, and two as context)
    and the raw forward in its own process (minilm) run back to back on each workload, the
    order reversed every round (ABBA), and each round gives its own ratios; the report takes
    their median. Paused, an idle server takes no CPU from the one measured (LitServe's idle
    workers poll: 0.23 cores of 2, measured).

    A workload without a LitServe configuration (the litserve phase not run, or failed) is
    paired without LitServe. gRPC against HTTP has its own rounds (the ``grpc`` phase).
    """
    best = bench.results.get("litserve_best") or {}
    if not best:
        bench.note("no LitServe configuration from the litserve phase: paired without LitServe")
    cpus = bench.plan.server_cpus
    lineup: dict[str, list[tuple[str, Server | None]]] = {}
    with contextlib.ExitStack() as stack:

        def up(label: str, server: Server) -> Server:
            bench.step(f"paired: start {label}")
            stack.enter_context(server)
            return server

        one = up("nograd", nograd_server(ROOT / "models", cpus))
        two = up("nograd-workers-2", nograd_server(ROOT / "models", cpus, WORKERS_2))
        wait_workers(two, 2)
        litservers: dict[tuple[str, int, float], Server] = {}
        ceilings: list[tuple[str, Server]] = []
        if "digits" in bench.plan.workloads:
            # The ceiling (one process), and as context the same app in two
            # processes: the stack's own limit on two cores, where nograd runs two workers.
            ceilings = [
                ("http-ceiling", up("HTTP ceiling", ceiling_server(bench))),
                (
                    "http-ceiling-2",
                    up("HTTP ceiling, two processes", ceiling_server(bench, processes=2)),
                ),
            ]
        for name in bench.plan.workloads:
            lineup[name] = []
            lineup[name] += [("nograd", one), ("nograd-workers-2", two)]
            config = best.get(name)
            if config is not None:
                key = (
                    MODEL_OF[name],
                    int(config["max_batch_size"]),
                    float(config["batch_timeout"]),
                )
                if key not in litservers:
                    litservers[key] = up(
                        f"LitServe {key[0]} {key[1]}/{key[2]:g}", litserve(bench, *key)
                    )
                lineup[name].append(("litserve", litservers[key]))
            if name == "digits":
                lineup[name] += ceilings
            if MODEL_OF[name] == "minilm":
                # The raw forward in its own process, every server paused: the yardstick of
                # the raw-model target, at this round's machine speed.
                lineup[name].append(("raw", None))
        everyone = [one, two, *litservers.values(), *(server for _, server in ceilings)]
        rounds: list[dict[str, Any]] = []
        raw: list[dict[str, Any]] = []
        for index in range(bench.plan.paired_rounds):
            for name, systems in lineup.items():
                order = systems if index % 2 == 0 else systems[::-1]
                for position, (system, server) in enumerate(order):
                    # Only the server under load runs; the others are paused (SIGSTOP).
                    run_only(server, everyone)
                    if server is None:
                        bench.step(f"paired round {index + 1}: raw model for {name}")
                        raw.append(
                            {"round": index + 1, "position": position, "workload": name}
                            | bench.raw_limit_now()
                        )
                        continue
                    result = bench.headline(
                        server,
                        system,
                        name,
                        f"paired round {index + 1}: {system} {name}",
                        nograd_metrics=system.startswith("nograd"),
                        keep=False,
                    )
                    if result is None:
                        continue
                    rounds.append({"round": index + 1, "position": position} | result.as_dict())
    bench.results["paired"] = {"litserve_best": best, "runs": rounds, "raw": raw}
