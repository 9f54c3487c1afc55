"""The load driver: wrk for closed loops, ``bench.openloop`` for open loops (``bench.perf_analyzer``
for perf_analyzer's runs); one result type."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.common import BENCH, PYTHON, ROOT, pinned

LUA = BENCH / "wrk" / "post.lua"


@dataclass
class LoadResult:
    system: str
    workload: str
    mode: str  # "closed" (wrk, fixed concurrency) or "open" (fixed arrival rate)
    concurrency: int | None
    rate: float | None
    duration_s: float
    requests: int
    rps: float
    samples_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    mean_ms: float
    max_ms: float
    errors: int
    errors_detail: dict[str, int]
    generator: str
    generator_cpu_share: float | None
    extra: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def have_wrk() -> bool:
    return shutil.which("wrk") is not None


def _from_raw(
    raw: dict[str, Any],
    *,
    system: str,
    workload: str,
    mode: str,
    samples_per_request: int,
    concurrency: int | None,
    rate: float | None,
    generator: str,
) -> LoadResult:
    duration_s = max(float(raw["duration_us"]) / 1e6, 1e-9)
    detail = {
        key.removeprefix("errors_"): int(value)
        for key, value in raw.items()
        if key.startswith("errors_")
    }
    if mode == "closed":
        # wrk counts a non-2xx answer as a request too; throughput counts successes only.
        good_rps = max(0, int(raw["requests"]) - detail.get("status", 0)) / duration_s
    else:
        # Open loop: successes over the wall time, drain included, is the sustained rate.
        good_rps = int(raw["requests"]) / max(float(raw.get("wall_s", duration_s)), duration_s)
    return LoadResult(
        system=system,
        workload=workload,
        mode=mode,
        concurrency=concurrency,
        rate=rate,
        duration_s=duration_s,
        requests=int(raw["requests"]),
        rps=good_rps,
        samples_per_s=good_rps * samples_per_request,
        p50_ms=_ms(raw, "p50_us"),
        p90_ms=_ms(raw, "p90_us"),
        p99_ms=_ms(raw, "p99_us"),
        p999_ms=_ms(raw, "p999_us"),
        mean_ms=_ms(raw, "latency_mean_us"),
        max_ms=_ms(raw, "latency_max_us"),
        errors=sum(detail.values()),
        errors_detail=detail,
        generator=generator,
        generator_cpu_share=raw.get("generator_cpu_share"),
        extra={k: v for k, v in raw.items() if k in ("late_sends", "late_p99_ms", "issued")},
    )


def _ms(raw: dict[str, Any], key: str) -> float:
    """µs → ms; a missing value (no request succeeded: JSON null) is NaN."""
    value = raw.get(key)
    return float("nan") if value is None else float(value) / 1e3


def run_timed(
    command: list[str],
    *,
    cpus: str | None,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run a load generator to its end: what it printed, and the CPU seconds it used."""
    cpu_before = os.times()
    out = subprocess.run(
        pinned(command, cpus),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    cpu_after = os.times()
    child_cpu = (cpu_after.children_user - cpu_before.children_user) + (
        cpu_after.children_system - cpu_before.children_system
    )
    return out, child_cpu


def run_generator(
    command: list[str],
    tag: str,
    *,
    cpus: str | None,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> tuple[dict[str, Any], float]:
    """Run a load generator to its end: the JSON result it printed on the line starting with
    ``tag``, and its whole CPU (start-up included, so the run's foreign-CPU check does not count
    it) as cores over the measured time."""
    out, child_cpu = run_timed(command, cpus=cpus, timeout_s=timeout_s, env=env)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith(f"{tag} ")), None)
    if line is None:
        raise RuntimeError(
            f"{command[0]} printed no result (rc {out.returncode}):\n{out.stdout}{out.stderr}"
        )
    raw: dict[str, Any] = orjson.loads(line.removeprefix(f"{tag} "))
    return raw, child_cpu / max(raw["duration_us"] / 1e6, 1e-9)


def run_closed(
    url: str,
    bodies: Path,
    *,
    system: str,
    workload: str,
    samples_per_request: int,
    connections: int,
    duration_s: float,
    cpus: str | None,
    timeout_s: float = 10.0,
    pause_ms: float | None = None,
    method: str = "POST",
    content_type: str = "application/json",
    hex_bodies: bool = False,
) -> LoadResult:
    """``wrk -c N`` for ``duration_s``; a single wrk thread drives up to 64 connections.

    ``pause_ms``: each connection waits that long after every answer (paced, not saturating).
    ``hex_bodies``: the bodies file holds one hex-encoded (binary) body per line.
    """
    threads = 1 if connections < 64 else 2
    command = [
        "wrk",
        "-t",
        str(threads),
        "-c",
        str(connections),
        "-d",
        f"{duration_s:g}s",
        "--timeout",
        f"{timeout_s:g}s",
        "-s",
        str(LUA),
        url,
    ]
    env = {
        **os.environ,
        "NOGRAD_BENCH_BODIES": str(bodies),
        "NOGRAD_BENCH_METHOD": method,
        "NOGRAD_BENCH_CONTENT_TYPE": content_type,
        "NOGRAD_BENCH_HEX": "1" if hex_bodies else "0",
    }
    env.pop("NOGRAD_BENCH_PAUSE_MS", None)
    if pause_ms is not None:
        env["NOGRAD_BENCH_PAUSE_MS"] = f"{pause_ms:g}"
    raw, whole = run_generator(
        command, "WRK_JSON", cpus=cpus, timeout_s=duration_s + timeout_s + 30, env=env
    )
    raw["generator_cpu_share"] = whole
    return _from_raw(
        raw,
        system=system,
        workload=workload,
        mode="closed",
        samples_per_request=samples_per_request,
        concurrency=connections,
        rate=None,
        generator=f"wrk -t{threads}",
    )


def run_open(
    url: str,
    bodies: Path,
    *,
    system: str,
    workload: str,
    samples_per_request: int,
    rate: float,
    duration_s: float,
    cpus: str | None,
    timeout_s: float = 5.0,
) -> LoadResult:
    command = [
        PYTHON,
        "-m",
        "bench.openloop",
        "--url",
        url,
        "--bodies",
        str(bodies),
        "--rate",
        f"{rate:.3f}",
        "--duration",
        f"{duration_s:g}",
        "--timeout",
        f"{timeout_s:g}",
    ]
    out = subprocess.run(
        pinned(command, cpus),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=duration_s + timeout_s + 60,
        check=False,
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("OPENLOOP_JSON ")), None)
    if line is None:
        raise RuntimeError(f"open loop printed no result (rc {out.returncode}):\n{out.stderr}")
    raw = orjson.loads(line.removeprefix("OPENLOOP_JSON "))
    return _from_raw(
        raw,
        system=system,
        workload=workload,
        mode="open",
        samples_per_request=samples_per_request,
        concurrency=None,
        rate=rate,
        generator="bench.openloop (python, aiohttp)",
    )
