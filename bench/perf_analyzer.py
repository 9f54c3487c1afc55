"""Triton's ``perf_analyzer`` as a load generator: the tool Triton users measure servers with,
driving the same server over HTTP and over gRPC with the same client, so the two protocols are
compared the way those users would compare them.

``scripts/fetch_perf_analyzer.sh`` fetches the binary on first use (it prints the path of a wrapper
that sets its library path). Each run is a closed loop at a fixed concurrency (synchronous calls,
one client thread per concurrent request, as ``--concurrency-range N`` does) over three
measurement windows that together last the duration asked: a stability percentage no run can
exceed makes perf_analyzer stop after exactly those three windows, so every system gets the same
measured time, as with wrk. Requests carry the workload's own samples (``--input-data``, a JSON
file written from ``bench.workloads``' bodies), not perf_analyzer's random data. Throughput and
percentiles come from its CSV report (``-f``); the request count and mean latency from its
summary. perf_analyzer exits non-zero when any request fails, and the run counts as failed.
"""

from __future__ import annotations

import csv
import functools
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from bench.common import PYTHON, ROOT, Server
from bench.loadgen import LoadResult, run_timed
from bench.workloads import Workload

FETCH_SCRIPT: Final = ROOT / "scripts" / "fetch_perf_analyzer.sh"
FETCH_TIMEOUT_S: Final = 900.0
WINDOWS: Final = 3
"""perf_analyzer judges stability over its last three windows and never reports fewer."""
WINDOW_STRETCH: Final = 1.2
"""perf_analyzer waits 1.2 times ``--measurement-interval`` per window (its profiler's sleep)."""
MIN_WINDOW_MS: Final = 1000
"""A window shorter than one batch's latency (minilm on one process at concurrency 32) can hold no
answer at all, and perf_analyzer then gives up; short runs (warm-ups) last longer instead."""
NEVER_UNSTABLE: Final = "100000"
"""A stability percentage (max / min of three windows) no run reaches: three windows, then stop."""
PROTOCOLS: Final = ("http", "grpc")


@functools.cache
def tool() -> str:
    """The path of the perf_analyzer wrapper, fetched on first use; RuntimeError with the
    script's own reason when it cannot be fetched (no package index, no apt)."""
    try:
        done = subprocess.run(
            ["bash", str(FETCH_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=FETCH_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHON": PYTHON},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{FETCH_SCRIPT.name} could not run: {exc}") from exc
    lines = done.stdout.strip().splitlines()
    path = lines[-1] if lines else ""
    if done.returncode != 0 or not Path(path).is_file():
        raise RuntimeError(
            f"{FETCH_SCRIPT.name} failed (exit {done.returncode}): {done.stderr[-800:]}"
        )
    return path


def write_input_data(workload: Workload, directory: Path) -> Path:
    """The workload's requests as perf_analyzer's ``--input-data`` JSON, one entry per body.

    Each entry holds one request's row without its batch dimension, which perf_analyzer adds
    (``-b 1``): digits ``[1, 8, 8]``, a text ``[1]``, as the models' configurations declare them.
    Only workloads of one sample per request fit that shape.
    """
    if workload.samples_per_request != 1:
        raise ValueError(f"{workload.name}: perf_analyzer sends one sample per request")
    entries = []
    for body in workload.bodies:
        entry: dict[str, Any] = {}
        for tensor in orjson.loads(body)["inputs"]:
            shape = list(tensor["shape"])
            if shape[0] != 1:
                raise ValueError(f"{workload.name}: a request of {shape[0]} rows, not one")
            entry[tensor["name"]] = {"content": tensor["data"], "shape": shape[1:] or [1]}
        entries.append(entry)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"perf-analyzer-{workload.name}.json"
    path.write_bytes(orjson.dumps({"data": entries}))
    return path


def command(
    tool_path: str,
    *,
    model: str,
    address: str,
    protocol: str,
    concurrency: int,
    duration_s: float,
    input_data: Path,
    report: Path,
) -> list[str]:
    """One closed-loop run: ``concurrency`` synchronous callers, three windows over
    ``duration_s``; ``--percentile 99`` makes p99 the latency perf_analyzer prints and judges."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}: http or grpc")
    window_ms = max(MIN_WINDOW_MS, round(duration_s * 1000 / (WINDOWS * WINDOW_STRETCH)))
    return [
        tool_path,
        *("-m", model, "-x", "1", "-u", address, "-i", protocol),
        *("--concurrency-range", str(concurrency)),
        *("--measurement-interval", str(window_ms)),
        *("--stability-percentage", NEVER_UNSTABLE, "--max-trials", str(WINDOWS)),
        *("--percentile", "99"),
        *("--input-data", str(input_data)),
        *("-f", str(report)),
    ]


@dataclass(frozen=True)
class Report:
    """What one perf_analyzer run measured, from its CSV report and its printed summary."""

    concurrency: int
    rps: float
    p50_us: float
    p90_us: float
    p95_us: float
    p99_us: float
    requests: int
    mean_us: float | None


def parse(csv_text: str, summary: str) -> Report:
    """The CSV's row (one concurrency per run) and the summary's client-side request count
    and mean latency (``Avg HTTP time`` or ``Avg gRPC time``)."""
    rows = list(csv.DictReader(csv_text.splitlines()))
    if len(rows) != 1:
        raise ValueError(f"expected one row in perf_analyzer's CSV, found {len(rows)}")
    row = rows[0]
    client = summary.split("Server:", 1)[0]
    count = re.search(r"Request count: (\d+)", client)
    if count is None:
        raise ValueError(f"no request count in perf_analyzer's summary:\n{summary[-2000:]}")
    mean = re.search(r"Avg (?:HTTP|gRPC) time: (\d+) usec", client)
    return Report(
        concurrency=int(row["Concurrency"]),
        rps=float(row["Inferences/Second"]),
        p50_us=float(row["p50 latency"]),
        p90_us=float(row["p90 latency"]),
        p95_us=float(row["p95 latency"]),
        p99_us=float(row["p99 latency"]),
        requests=int(count[1]),
        mean_us=float(mean[1]) if mean else None,
    )


def to_result(
    measured: Report, cpu_s: float, *, system: str, workload: str, protocol: str
) -> LoadResult:
    """The bench's result type; perf_analyzer reports no p99.9 nor maximum (NaN). Its whole CPU,
    start-up included, is given over the measured time, as wrk's is."""
    duration_s = measured.requests / measured.rps if measured.rps > 0 else 0.0
    return LoadResult(
        system=system,
        workload=workload,
        mode="closed",
        concurrency=measured.concurrency,
        rate=None,
        duration_s=duration_s,
        requests=measured.requests,
        rps=measured.rps,
        samples_per_s=measured.rps,
        p50_ms=measured.p50_us / 1e3,
        p90_ms=measured.p90_us / 1e3,
        p99_ms=measured.p99_us / 1e3,
        p999_ms=float("nan"),
        mean_ms=measured.mean_us / 1e3 if measured.mean_us is not None else float("nan"),
        max_ms=float("nan"),
        errors=0,
        errors_detail={},
        generator=f"perf_analyzer -i {protocol}",
        generator_cpu_share=cpu_s / duration_s if duration_s > 0 else None,
        extra={"protocol": protocol, "p95_ms": measured.p95_us / 1e3},
    )


def perf_analyzer_load(
    server: Server,
    workload: Workload,
    protocol: str,
    *,
    system: str,
    concurrency: int,
    duration_s: float,
    cpus: str | None,
    directory: Path,
) -> LoadResult:
    """perf_analyzer against ``server``'s HTTP or gRPC port with ``workload``'s own samples,
    run to its end; its input data and CSV report are written to ``directory`` (the report is
    removed once read)."""
    address = server.grpc_address if protocol == "grpc" else server.url.removeprefix("http://")
    report = directory / f"perf-analyzer-{os.getpid()}-{protocol}-{concurrency}.csv"
    report.unlink(missing_ok=True)
    args = command(
        tool(),
        model=workload.model,
        address=address,
        protocol=protocol,
        concurrency=concurrency,
        duration_s=duration_s,
        input_data=write_input_data(workload, directory),
        report=report,
    )
    try:
        done, cpu_s = run_timed(args, cpus=cpus, timeout_s=4 * duration_s + 60)
        if done.returncode != 0 or not report.exists():
            said = (done.stdout + done.stderr).strip()
            raise RuntimeError(f"perf_analyzer exited with {done.returncode}: {said[-400:]}")
        measured = parse(report.read_text(), done.stdout)
    finally:
        report.unlink(missing_ok=True)
    return to_result(measured, cpu_s, system=system, workload=workload.name, protocol=protocol)
