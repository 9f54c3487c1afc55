"""Engines: nograd as shipped (``engine = "auto"``) against the eager default it replaced, in
paired rounds at concurrency 1 and the plan's, and each engine's raw forward speed."""

from __future__ import annotations

import contextlib
import subprocess
from typing import Any

import orjson

from bench.common import PYTHON, ROOT, nograd_server, run_only
from bench.session import Bench

AUTO, EAGER = "nograd", "nograd-eager"
ENGINE_SPEED_TIMEOUT_S = 1200


def phase_engines(bench: Bench) -> None:
    """Both servers started once (one process each, the shipped repository; the eager one with
    ``NOGRAD_ENGINE=eager``), measured in turn with the other paused, order reversed each round;
    then ``bench.engine_speed`` in its own process, every server stopped."""
    runs: list[dict[str, Any]] = []
    concurrencies = sorted({1, bench.plan.concurrency})
    with contextlib.ExitStack() as stack:
        bench.step("engines: start nograd (auto) and nograd (eager)")
        auto = stack.enter_context(nograd_server(ROOT / "models", bench.plan.server_cpus))
        eager = stack.enter_context(
            nograd_server(ROOT / "models", bench.plan.server_cpus, {"NOGRAD_ENGINE": "eager"})
        )
        pair = [(AUTO, auto), (EAGER, eager)]
        for index in range(bench.plan.paired_rounds):
            order = pair if index % 2 == 0 else pair[::-1]
            for name in bench.plan.workloads:
                for concurrency in concurrencies:
                    for system, server in order:
                        run_only(server, [auto, eager])
                        bench.warm(server, name)
                        bench.step(f"engines round {index + 1}: {system} {name} c={concurrency}")
                        result = bench.load(
                            server,
                            system,
                            name,
                            concurrency=concurrency,
                            duration_s=bench.plan.short_s,
                            keep=False,
                        )
                        if result is not None:
                            runs.append({"round": index + 1} | result.as_dict())
        for server in (auto, eager):
            server.resume()
    bench.step("engines: raw forward per engine")
    raw: list[dict[str, Any]] = []
    try:
        done = subprocess.run(
            [PYTHON, "-m", "bench.engine_speed", "--json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
            timeout=ENGINE_SPEED_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        bench.note(f"bench.engine_speed ran past {ENGINE_SPEED_TIMEOUT_S} s and was stopped")
    else:
        if done.returncode == 0:
            raw = orjson.loads(done.stdout.strip().splitlines()[-1])
        else:
            bench.note(f"bench.engine_speed failed: {done.stderr[-300:]}")
    bench.results["engines"] = {"runs": runs, "raw": raw}
