"""The gRPC phase's load generator and report: perf_analyzer's command, its input data, its
output read back, and the per-round ratios that turn runs into the front's verdicts.

A misread CSV column or a window setting off by perf_analyzer's own stretch would skew every
gRPC-against-HTTP ratio without failing anything, and data shaped against the model
configuration would make perf_analyzer stop before the first request; the last test runs the
real tool against a real nograd on both protocols, through the bench's own measuring step.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench import perf_analyzer, workloads
from bench.common import metric, nograd_server, scrape_metrics
from bench.plan import Plan
from bench.report import markdown
from bench.report.over_grpc import grpc_targets, peer_rows, protocol_rows
from bench.run import command_line
from bench.session import Bench
from tests.e2e.serving import ROOT

# perf_analyzer 2.41.0's summary and CSV report of one gRPC run against nograd (digits, c=4).
SUMMARY = """\
 Successfully read data for 1 stream/streams with 64 step/steps.
*** Measurement Settings ***
  Batch size: 1
  Service Kind: Triton
  Using "time_windows" mode for stabilization
  Measurement window: 300 msec
  Using synchronous calls for inference
  Stabilizing using p99 latency

Request concurrency: 4
  Client:
    Request count: 1394
    Throughput: 1188.54 infer/sec
    p50 latency: 2195 usec
    p90 latency: 6930 usec
    p95 latency: 8942 usec
    p99 latency: 11839 usec
    Avg gRPC time: 3343 usec ((un)marshal request/response 3 usec + response wait 3340 usec)
  Server:
    Inference count: 1394
    Execution count: 510
    Successful request count: 1394
    Avg request latency: 2216 usec (overhead 687 usec + queue 1107 usec + compute input 0 usec \
+ compute infer 422 usec + compute output 0 usec)

Inferences/Second vs. Client p99 Batch Latency
Concurrency: 4, throughput: 1188.54 infer/sec, latency 11839 usec
"""
CSV = """\
Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute \
Input,Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 \
latency,p99 latency
4,1188.54,2,1823,1107,0,422,0,1,2195,6930,8942,11839
"""


def test_the_report_is_read_from_the_csv_and_the_clients_summary() -> None:
    report = perf_analyzer.parse(CSV, SUMMARY)
    assert report == perf_analyzer.Report(
        concurrency=4,
        rps=1188.54,
        p50_us=2195,
        p90_us=6930,
        p95_us=8942,
        p99_us=11839,
        requests=1394,
        mean_us=3343,
    )
    result = perf_analyzer.to_result(
        report, cpu_s=0.235, system="nograd", workload="digits", protocol="grpc"
    )
    assert result.duration_s == pytest.approx(1394 / 1188.54)
    assert (result.p50_ms, result.p99_ms, result.mean_ms) == (2.195, 11.839, 3.343)
    assert result.generator_cpu_share == pytest.approx(0.235 / (1394 / 1188.54))
    assert result.extra["protocol"] == "grpc" and result.errors == 0
    with pytest.raises(ValueError, match="one row"):
        perf_analyzer.parse(CSV.splitlines()[0], SUMMARY)
    with pytest.raises(ValueError, match="request count"):
        perf_analyzer.parse(CSV, SUMMARY.replace("Request count", "Requests"))


def digits_command(protocol: str) -> list[str]:
    return perf_analyzer.command(
        "/pa",
        model="digits",
        address="127.0.0.1:9",
        protocol=protocol,
        concurrency=32,
        duration_s=10.8,
        input_data=Path("data.json"),
        report=Path("out.csv"),
    )


def test_three_windows_last_the_duration_asked() -> None:
    args = digits_command("grpc")

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    # Each window lasts 1.2 intervals: 3 x 3000 ms x 1.2 = 10.8 s.
    assert value("--measurement-interval") == "3000"
    assert value("--max-trials") == "3" and float(value("--stability-percentage")) >= 1e4
    assert (value("-x"), value("-i"), value("--concurrency-range")) == ("1", "grpc", "32")
    assert value("--percentile") == "99" and value("-f") == "out.csv"
    with pytest.raises(ValueError, match="protocol"):
        digits_command("rest")


def test_the_input_data_carries_the_workloads_own_samples(tmp_path: Path) -> None:
    for name, shape in (("digits", [1, 8, 8]), ("minilm-1", [1])):
        workload = workloads.make(name, 5)
        data = orjson.loads(perf_analyzer.write_input_data(workload, tmp_path).read_bytes())
        entries = data["data"]
        assert len(entries) == 5
        for entry, body in zip(entries, workload.bodies, strict=True):
            (tensor,) = orjson.loads(body)["inputs"]
            # One row without its batch dimension, as the model configuration declares it.
            assert entry == {tensor["name"]: {"content": tensor["data"], "shape": shape}}
    with pytest.raises(ValueError, match="one sample"):
        perf_analyzer.write_input_data(workloads.make("minilm-8", 2), tmp_path)


def grpc_run(
    system: str,
    protocol: str,
    round_: int,
    rps: float,
    p99: float,
    workload: str = "digits",
    concurrency: int = 32,
    cpu_s: float = 1.0,
) -> dict[str, Any]:
    return {
        "round": round_,
        "position": 0,
        "protocol": protocol,
        "system": system,
        "workload": workload,
        "concurrency": concurrency,
        "rps": rps,
        "p50_ms": p99 / 2,
        "p99_ms": p99,
        "generator_cpu_share": 0.1,
        "extra": {"server_cpu_s": cpu_s, "server_answers": rps, "foreign_cpu_cores": 0.01},
    }


def results_of(runs: list[dict[str, Any]], auto_workers: int = 2) -> dict[str, Any]:
    plan = {"concurrency": 32, "workloads": ["digits", "minilm-1"], "server_cpus": None}
    meta = {
        "cores": 2,
        "auto_workers": auto_workers,
        "auto_workers_reason": "2 cores",
        "plan": plan,
    }
    meta |= {"cpu": "test CPU", "torch": "2.13.0", "torch_threads": 2, "python": "3.13"}
    meta |= {"git": {"commit": "abc", "code_dirty": False}, "started": "2026-11-26T00:00:00"}
    meta |= {"command": "python -m bench.run", "loadavg_at_start": [0.1], "elapsed_s": 60.0}
    meta |= {"loadavg_at_end": [0.1]}
    return {"meta": meta, "runs": [], "grpc": {"tool": "pa", "skipped": [], "runs": runs}}


def test_each_protocol_ratio_pairs_the_runs_of_one_round() -> None:
    # Round 2 runs at half the machine's speed: both protocols slow down together, so each
    # round's ratio stays 0.9, where pairing round 1's gRPC with round 2's HTTP would read 1.8.
    runs = []
    for round_, speed in ((1, 1.0), (2, 0.5), (3, 1.0)):
        runs += [
            grpc_run("nograd-workers-2", "http", round_, 5000 * speed, 10 / speed, cpu_s=2.0),
            grpc_run("nograd-workers-2", "grpc", round_, 4500 * speed, 12 / speed, cpu_s=1.5),
            grpc_run("pytriton", "grpc", round_, 2000 * speed, 30 / speed),
            grpc_run("nograd", "http", round_, 3000, 20),  # one process: no gRPC run
        ]
    runs.append(grpc_run("nograd-workers-2", "grpc", 4, 100, 100))  # no HTTP run in round 4
    results = results_of(runs)

    assert protocol_rows(results) == [
        (
            "digits",
            32,
            "two workers (NOGRAD_WORKERS=2)",
            "0.90× (0.90 / 0.90 / 0.90)",
            "1.20× (1.20 / 1.20 / 1.20)",
            # 1.5 s over 4,500 answers against 2 s over 5,000: 333 against 400 µs.
            "0.83× (0.83 / 0.83 / 0.83)",
            "5,000 / 4,500",
            "10.00 / 12.00",
            "0.10 / 0.10",
        )
    ]
    assert peer_rows(results) == [
        (
            "digits",
            32,
            "two workers (NOGRAD_WORKERS=2)",
            "2.25× (2.25 / 2.25 / 2.25)",
            "0.40× (0.40 / 0.40 / 0.40)",
            "4,500 / 2,000",
        )
    ]
    verdicts = {target: rest for target, *rest in grpc_targets(results)}
    marked = "two workers (NOGRAD_WORKERS=2) (the default here)"
    assert verdicts["digits c=32: gRPC throughput ÷ HTTP's"] == [marked, *_met("0.90", 0.8)]
    assert verdicts["digits c=32: gRPC p99 ÷ HTTP's"][2:] == ["≤ 1.5×", "**met**"]
    assert verdicts["digits c=32: gRPC throughput ÷ PyTriton's gRPC"][2:] == ["≥ 1.5×", "**met**"]
    assert "minilm-1 c=32: gRPC throughput ÷ HTTP's" not in verdicts  # not measured
    text = markdown(results)
    assert "## gRPC against HTTP, and against Triton's gRPC, by perf_analyzer (2 cores" in text
    assert "| digits | 32 | 2 | pytriton | grpc |" in text  # every run, by round


def _met(ratio: str, bound: float) -> list[str]:
    return [f"{ratio}× ({ratio} / {ratio} / {ratio})", f"≥ {bound:g}×", "**met**"]


def test_a_missed_target_reads_not_met_for_the_server_it_missed_on() -> None:
    runs = []
    for round_, (http, grpc) in enumerate(((5000, 3500), (5000, 4200), (5000, 3800)), 1):
        runs += [
            grpc_run("nograd", "http", round_, http, 10, workload="minilm-1"),
            grpc_run("nograd", "grpc", round_, grpc, 11, workload="minilm-1"),
        ]
    results = results_of(runs, auto_workers=1)
    (row,) = grpc_targets(results)
    assert row == (
        "minilm-1 c=32: gRPC throughput ÷ HTTP's",
        "one process (the default here)",
        "0.76× (0.70 / 0.84 / 0.76)",
        "≥ 0.9×",
        "**not met**",
    )
    # Where the defaults plan an engine and fronts, no system measured here is marked as them.
    results["meta"] |= {"default_fronts": 2}
    (row,) = grpc_targets(results)
    assert row[1] == "one process"
    assert grpc_targets(results_of([])) == []


@pytest.mark.e2e
@pytest.mark.slow
def test_perf_analyzer_drives_a_real_nograd_over_both_protocols(tmp_path: Path) -> None:
    """The bench's measuring step with perf_analyzer, as the phase runs it: digits over HTTP
    and gRPC, minilm (texts from the workload, BYTES) over gRPC, a second or two each. In
    ``make test-slow``: it starts a server of its own with both models (half a minute on 2
    cores), and ``make test`` already drives perf_analyzer over both protocols against the
    suite's shared server (tests/integration/test_perf_analyzer.py), besides the parsing
    tests above."""
    try:
        perf_analyzer.tool()
    except RuntimeError as exc:
        pytest.skip(f"perf_analyzer cannot be fetched here: {exc}")
    repo = tmp_path / "repo"
    for model in ("digits", "minilm"):
        shutil.copytree(ROOT / "models" / model, repo / model)
    bench = Bench(plan=Plan.from_args(command_line().parse_args(["--quick"])), stamp="test")
    for name in ("digits", "minilm-1"):
        bench.bodies[name] = workloads.make(name).write_bodies(tmp_path / "bodies")
    runs = []
    with nograd_server(repo, None) as server:
        for name, protocol, concurrency in (
            ("digits", "http", 4),
            ("digits", "grpc", 4),
            ("minilm-1", "grpc", 2),
        ):
            before = scrape_metrics(server.url)
            result = bench.load(
                server,
                "nograd",
                name,
                concurrency=concurrency,
                duration_s=1.5,
                nograd_metrics=True,
                keep=False,
                perf_analyzer=protocol,
            )
            after = scrape_metrics(server.url)
            assert result is not None, bench.results.get("run_errors")
            assert result.concurrency == concurrency and result.errors == 0
            assert result.requests > 0 and 0 < result.p50_ms <= result.p99_ms
            assert 0.5 < result.duration_s < 5
            model = workloads.make(name, 1).model
            over = {
                label: metric(after, "nograd_requests_total", model=model, protocol=label)
                - metric(before, "nograd_requests_total", model=model, protocol=label)
                for label in ("v2", "grpc")
            }
            # Every request went over the protocol asked, and none failed.
            sent, other = ("grpc", "v2") if protocol == "grpc" else ("v2", "grpc")
            assert over[other] == 0 and over[sent] == result.extra["server_answers"]
            assert over[sent] >= result.requests
            assert metric(after, "nograd_requests_total", model=model, code="200") - metric(
                before, "nograd_requests_total", model=model, code="200"
            ) == sum(over.values())
            runs.append({"round": 1, "position": len(runs), "protocol": protocol})
            runs[-1] |= result.as_dict()
    rows = protocol_rows(results_of([r | {"concurrency": 32} for r in runs]))
    assert [row[:3] for row in rows] == [("digits", 32, "one process")]
    assert all(cell != "–" for cell in rows[0])
