"""Speed modes on the raw forward, the memory benchmark, torch.profiler and py-spy under load."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import orjson

from bench.common import PYTHON, RESULTS
from bench.session import (
    Bench,
)


def phase_levers(bench: Bench) -> None:
    seconds = "0.2" if bench.plan.quick else "0.5"
    if bench.plan.levers:
        bench.step("levers: grad modes, bf16")
        out = RESULTS / f"{bench.stamp}-levers.json"
        bench.quiet()
        foreign = bench.subprocess(
            [PYTHON, "-m", "bench.levers", "--out", str(out), "--seconds", seconds],
            timeout_s=900,
            cpus=bench.plan.server_cpus,
        )
        bench.results["levers"] = orjson.loads(out.read_bytes())
        bench.results["levers"]["foreign_cpu_cores"] = foreign
        out.unlink()
    if bench.plan.compile:
        bench.step("levers: torch.compile")
        out = RESULTS / f"{bench.stamp}-compile.json"
        cache = Path(tempfile.gettempdir()) / f"torchinductor_{os.environ.get('USER', 'root')}"
        warm_cache = cache.exists()
        try:
            bench.subprocess(
                [
                    PYTHON,
                    "-m",
                    "bench.levers",
                    "--only",
                    "compile",
                    "--out",
                    str(out),
                    "--seconds",
                    seconds,
                ],
                timeout_s=420,
                cpus=bench.plan.server_cpus,
            )
            bench.results["compile"] = orjson.loads(out.read_bytes())
            out.unlink()
        except (subprocess.TimeoutExpired, subprocess.CalledProcessError, OSError) as exc:
            bench.results["compile"] = {"skipped": f"{type(exc).__name__}: {exc}"[:400]}
        bench.results.setdefault("compile", {})["inductor_cache_warm"] = warm_cache


def phase_memory(bench: Bench) -> None:
    if not bench.plan.memory:
        return
    bench.step("memory benchmark (issue 3)")
    out = RESULTS / f"{bench.stamp}-memory.json"
    duration = "3" if bench.plan.quick else "8"
    bench.subprocess(
        [PYTHON, "-m", "bench.memory_bench", "--out", str(out), "--duration", duration],
        timeout_s=900,
    )
    bench.results["memory"] = orjson.loads(out.read_bytes())
    out.unlink()


def phase_torch_profile(bench: Bench) -> None:
    if not bench.plan.profile:
        return
    bench.step("torch.profiler on nograd's batch path")

    def mean_batch(name: str, default: int) -> int:
        for r in bench.runs:
            if (
                r.system == "nograd"
                and r.workload == name
                and r.concurrency == bench.plan.concurrency
            ):
                return max(1, round(float(r.extra.get("mean_batch_size", default))))
        return default

    out = RESULTS / f"{bench.stamp}-torchprof.json"
    command = [
        PYTHON,
        "-m",
        "bench.profile_nograd",
        "torch",
        "--out",
        str(out),
        "--digits-batch",
        str(mean_batch("digits", 16)),
        "--minilm-batch",
        str(mean_batch("minilm-1", 8)),
    ]
    bench.quiet()
    foreign = bench.subprocess(command, timeout_s=600, cpus=bench.plan.server_cpus)
    bench.results["torch_profile"] = orjson.loads(out.read_bytes())
    bench.results["torch_profile"]["foreign_cpu_cores"] = foreign
    out.unlink()
