"""The benchmark's interleaving: the raw forward's rounds, and the paired-round verdicts.

A phase-to-phase ratio can be a ratio of two machine speeds on a shared host; the paired rounds
exist so a verdict compares runs made minutes apart, and the raw forward's batch sizes are timed
in rounds so a slow stretch does not rank them. These tests pin the ordering and the arithmetic
that turns rounds into verdicts, since a wrong pairing would silently compare different rounds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.raw import interleaved
from bench.report import markdown, paired_ratios, paired_targets
from tests.e2e.serving import ROOT, free_port


def run(system: str, workload: str, round_: int, rps: float, p99: float) -> dict[str, Any]:
    samples = rps * (8 if workload == "minilm-8" else 1)
    return {
        "round": round_,
        "position": 0,
        "system": system,
        "workload": workload,
        "mode": "closed",
        "concurrency": 32,
        "rate": None,
        "rps": rps,
        "samples_per_s": samples,
        "p50_ms": p99 / 2,
        "p90_ms": p99 * 0.8,
        "p99_ms": p99,
        "p999_ms": p99 * 1.2,
        "errors": 0,
        "extra": {"foreign_cpu_cores": 0.01},
    }


def results_with(
    runs: list[dict[str, Any]], raw: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "meta": {
            "cores": 2,
            "cpu": "test CPU",
            "torch": "2.13.0",
            "torch_threads": 2,
            "python": "3.13",
            "git": {"commit": "abc", "code_dirty": False},
            "started": "2026-11-23T00:00:00",
            "command": "python -m bench.run",
            "loadavg_at_start": [0.1],
            "loadavg_at_end": [0.1],
            "elapsed_s": 60.0,
            "plan": {"concurrency": 32, "workloads": ["digits", "minilm-1"], "server_cpus": None},
        },
        "runs": [],
        "paired": {"litserve_best": {}, "runs": runs, "raw": raw or []},
    }


def test_each_ratio_pairs_runs_of_the_same_round() -> None:
    # The machine halves its speed in round 2: both systems slow down together, so each round's
    # ratio stays 2x, while pairing round 1's nograd with round 2's LitServe would read 4x.
    results = results_with(
        [
            run("nograd", "minilm-1", 1, 200, 100),
            run("litserve", "minilm-1", 1, 100, 200),
            run("nograd", "minilm-1", 2, 100, 200),
            run("litserve", "minilm-1", 2, 50, 400),
            run("litserve", "minilm-1", 3, 50, 400),  # nograd missing in round 3: not paired
        ]
    )
    assert paired_ratios(results, "minilm-1", "nograd", "litserve", "samples_per_s") == [2.0, 2.0]
    assert paired_ratios(results, "minilm-1", "nograd", "litserve", "p99_ms") == [0.5, 0.5]


def test_verdicts_take_the_median_round() -> None:
    # digits vs the ceiling: 0.9, 0.5 (a disturbed round), 0.8 -> median 0.8, met; p99s 12, 30,
    # 18 ms -> median 18, met; minilm-1 vs LitServe 1.5, 1.7, 1.55 -> 1.55, not met.
    runs = []
    for round_, (ours, ceiling, p99) in enumerate(
        ((900, 1000, 12), (500, 1000, 30), (800, 1000, 18)), 1
    ):
        runs += [
            run("nograd", "digits", round_, ours, p99),
            run("http-ceiling", "digits", round_, ceiling, 5),
            run("litserve", "digits", round_, ours / 4, 60),
        ]
    for round_, (more, tail) in enumerate(((1.5, 0.6), (1.7, 0.8), (1.55, 0.65)), 1):
        runs += [
            run("nograd", "minilm-1", round_, 100 * more, 100 * tail),
            run("litserve", "minilm-1", round_, 100, 100),
        ]
    rows = {
        target: (shown, verdict) for target, shown, _, verdict in paired_targets(results_with(runs))
    }

    assert rows["digits: throughput vs HTTP ceiling"] == ("0.80× (0.90 / 0.50 / 0.80)", "**met**")
    assert rows["digits: throughput vs LitServe"][1] == "**met**"
    assert rows["digits: p99 latency"] == ("18.00 ms (12.00 / 30.00 / 18.00)", "**met**")
    assert rows["minilm-1: throughput vs LitServe"] == ("1.55× (1.50 / 1.70 / 1.55)", "**not met**")
    assert rows["minilm-1: p99 vs LitServe"] == ("0.65× (0.60 / 0.80 / 0.65)", "**met**")
    # Two workers were not in these rounds: no rows, rather than rows without numbers.
    assert paired_targets(results_with(runs), "nograd-workers-2") == []


def test_report_leads_with_the_paired_targets() -> None:
    runs = [
        run("nograd", "digits", 1, 900, 12),
        run("http-ceiling", "digits", 1, 1000, 5),
        run("litserve", "digits", 1, 200, 40),
    ]
    results = results_with(runs)
    results["runs"] = [{**run("nograd", "digits", 1, 950, 11), "round": None}]  # a headline run
    text = markdown(results)
    paired = text.index("## Targets from paired rounds")
    assert paired < text.index("## Targets (issue 5), ratios from this run's phases")
    assert "| digits: throughput vs HTTP ceiling | 0.90× (0.90) | ≥ 0.7× | **met** |" in text
    assert "### Every paired run" in text


def test_raw_rounds_reverse_their_order_and_keep_every_value() -> None:
    calls: list[str] = []

    def measure(key: str) -> tuple[str, Any]:
        def run() -> float:
            calls.append(key)
            return float(len(calls))

        return key, run

    values = interleaved([measure("a"), measure("b"), measure("c")], rounds=3)
    # ABC, CBA, ABC: each batch size sees the start, the middle and the end of the stretch.
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert values == {"a": [1.0, 6.0, 7.0], "b": [2.0, 5.0, 8.0], "c": [3.0, 4.0, 9.0]}


def test_raw_target_pairs_each_round_with_its_own_raw_forward() -> None:
    runs = [run("nograd", "minilm-1", r, rps, 300) for r, rps in ((1, 90), (2, 180), (3, 100))]
    runs += [run("litserve", "minilm-1", r, 50, 600) for r in (1, 2, 3)]
    raw = [
        {
            "round": r,
            "workload": "minilm-1",
            "samples_per_s": padded,
            "packed_samples_per_s": packed,
        }
        for r, padded, packed in ((1, 100, 150), (2, 200, 300), (3, 100, 125))
    ]
    # The machine ran twice as fast in round 2: nograd and the raw forward both doubled.
    raw += [{"round": 1, "workload": "minilm-8", "samples_per_s": 1, "packed_samples_per_s": 1}]
    rows = {
        target: (shown, verdict)
        for target, shown, _, verdict in paired_targets(results_with(runs, raw))
    }

    assert rows["minilm-1: throughput vs raw model best"] == (
        "0.90× (0.90 / 0.90 / 1.00)",
        "**met**",
    )
    stricter = rows["minilm-1: throughput vs nograd's packed forward, raw loop (stricter)"]
    assert stricter == ("0.60× (0.60 / 0.60 / 0.80)", "**not met**")
    assert (
        paired_ratios(results_with(runs, raw), "minilm-8", "nograd", "raw", "samples_per_s") == []
    )


def test_digits_p99_is_judged_without_a_litserve_run() -> None:
    # LitServe failed to start: the ceiling ratio and nograd's own p99 still get their verdicts.
    runs = [run("nograd", "digits", 1, 900, 25), run("http-ceiling", "digits", 1, 1000, 5)]
    rows = paired_targets(results_with(runs))
    assert [target for target, *_ in rows] == [
        "digits: throughput vs HTTP ceiling",
        "digits: p99 latency",
        "digits: the HTTP ceiling's own p99 (context)",
    ]
    assert rows[1][1:] == ("25.00 ms (25.00)", "≤ 20 ms", "**not met**")
    assert rows[2][1:] == ("5.00 ms (5.00)", "–", "–")  # the bare stack's tail, no verdict


def test_the_two_process_ceiling_is_context_beside_the_issues_ceiling() -> None:
    # The issue's ceiling is one process; the same app in two processes shows the stack's limit
    # on two cores: its ratio and its p99 are printed, without verdicts.
    runs = []
    for round_, (ours, two) in enumerate(((900, 1800), (1000, 2500), (800, 2000)), 1):
        runs += [
            run("nograd-workers-2", "digits", round_, ours, 22),
            run("http-ceiling", "digits", round_, 1000, 20),
            run("http-ceiling-2", "digits", round_, two, 12 + round_),
        ]
    rows = {
        target: rest for target, *rest in paired_targets(results_with(runs), "nograd-workers-2")
    }
    assert rows["digits: throughput vs HTTP ceiling"][2] == "**met**"
    assert rows["digits: throughput vs the two-process HTTP ceiling (context)"] == [
        "0.40× (0.50 / 0.40 / 0.40)",
        "–",
        "–",
    ]
    assert rows["digits: the two-process HTTP ceiling's own p99 (context)"][0] == (
        "14.00 ms (13.00 / 14.00 / 15.00)"
    )
    assert "| HTTP ceiling, two processes (no model) |" in markdown(results_with(runs))


def test_report_names_the_system_that_the_defaults_run() -> None:
    results = results_with([run("nograd-workers-2", "digits", 1, 900, 12)])
    results["meta"] |= {"auto_workers": 2, "auto_workers_reason": "2 usable CPU cores, no GPU"}
    text = markdown(results)
    assert (
        "nograd's defaults (`make run`) start **2 workers** on this machine "
        "(2 usable CPU cores, no GPU): the rows labelled “nograd, two workers (NOGRAD_WORKERS=2)”."
    ) in text
    assert "nograd's defaults" not in markdown(results_with([]))  # runs from before it existed
    # An engine and fronts: none of these systems.
    results["meta"] |= {"default_fronts": 2, "default_fronts_reason": "2 usable CPU cores, no GPU"}
    assert (
        "nograd's defaults (`make run`) start **one engine process and 2 fronts** on this "
        "machine (2 usable CPU cores, no GPU): not a system measured here."
    ) in markdown(results)


def test_the_two_process_ceiling_serves_from_two_processes_and_stops_with_its_parent() -> None:
    port = free_port()
    parent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.servers.http_ceiling",
            "--port",
            str(port),
            "--processes",
            "2",
        ],
        cwd=ROOT,
    )
    try:
        children = _children(parent.pid, 2)
        body = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [2, 1, 8, 8]}]}
        body["inputs"][0]["data"] = [0.5] * 128
        deadline = time.monotonic() + 30
        while True:
            try:
                answer = httpx.post(f"http://127.0.0.1:{port}/v2/models/digits/infer", json=body)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the ceiling never answered"
                time.sleep(0.2)
        assert answer.status_code == 200
        assert [o["shape"] for o in answer.json()["outputs"]] == [[2, 10], [2, 10], [2, 1]]
        # Each child listens on a socket of its own (SO_REUSEPORT), inherited from the parent.
        listening = [_listens_on(child, port) for child in children]
        assert listening == [True, True]
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == 0
        for child in children:
            assert not Path(f"/proc/{child}").exists() or _zombie(child)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _children(pid: int, count: int) -> list[int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if len(found) == count:
            return [int(child) for child in found]
        time.sleep(0.1)
    raise AssertionError(f"{pid} did not start {count} children")


def _listens_on(pid: int, port: int) -> bool:
    """Whether a socket open in ``pid`` is the listening socket on ``port`` (/proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:
            continue  # closed since the listing
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and int(local.split(":")[1], 16) == port and inode in inodes:
            return True
    return False


def _zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_engines_section_pairs_auto_with_eager_round_by_round() -> None:
    from bench.report.engines import engine_ratio_rows

    runs = []
    for round_, (auto, eager) in enumerate([(200.0, 100.0), (150.0, 100.0), (90.0, 100.0)], 1):
        for system, rps in (("nograd", auto), ("nograd-eager", eager)):
            runs.append(run(system, "digits", round_, rps, 10.0) | {"concurrency": 1})
    runs.append(run("nograd", "digits", 4, 500.0, 10.0) | {"concurrency": 1})  # no partner
    results = results_with([]) | {
        "engines": {
            "runs": runs,
            "raw": [
                {
                    "model": "digits",
                    "engine": "onnx",
                    "batch1_per_s": 19709.0,
                    "batch32_per_s": 253568.0,
                    "batch1_ms": 0.05,
                    "batch32_ms": 0.13,
                    "accuracy": "logits: max abs error 3e-07",
                }
            ],
        }
    }
    rows = engine_ratio_rows(results)
    assert rows == [("digits", 1, 150.0, 100.0, 1.5, 1.0, 1.0, 3)]
    text = markdown(results)
    assert '## Engines: nograd as shipped (engine = "auto") against eager' in text
    assert "| digits | onnx | 19,709 | 253,568 | 0.05 | 0.13 |" in text


def peer_run(
    system: str, workload: str, round_: int, rps: float, p50: float, p99: float, c: int = 32
) -> dict[str, Any]:
    return run(system, workload, round_, rps, p99) | {"p50_ms": p50, "concurrency": c}


def test_peers_are_judged_against_the_best_peer_of_each_round() -> None:
    from bench.report.peers import peer_targets, versus_best

    runs = []
    # Round 1: TorchServe is the best peer; round 2: PyTriton; round 3: PyTriton, and a
    # peer that failed requests is no peer's best even when its count is higher.
    for round_, (triton, torchserve) in enumerate(
        [(100.0, 150.0), (120.0, 90.0), (110.0, 80.0)], 1
    ):
        runs += [
            peer_run("nograd", "minilm-1", round_, 300.0, 50.0, 80.0),
            peer_run("pytriton", "minilm-1", round_, triton, 100.0, 200.0),
            peer_run("torchserve", "minilm-1", round_, torchserve, 100.0, 100.0),
            peer_run("infinity-onnx", "minilm-1", round_, 999.0, 10.0, 10.0) | {"errors": 5},
            peer_run("nograd", "minilm-1", round_, 70.0, 10.0, 12.0, c=1),
            peer_run("infinity-onnx", "minilm-1", round_, 60.0, 20.0, 25.0, c=1),
            peer_run("nograd", "digits", round_, 6000.0, 2.0, 8.0),
            peer_run("pytriton", "digits", round_, 1500.0, 10.0, 30.0),
            peer_run("http-ceiling", "digits", round_, 7000.0, 2.0, 5.0),
        ]
    results = results_with([]) | {
        "peers": {"envs": {}, "checks": [], "refused": [], "sweep": [], "best": {}, "runs": runs}
    }
    found = versus_best(results, "minilm-1", 32, by_latency=False)
    assert found is not None
    assert found.best == "pytriton"  # best in two rounds of three
    assert found.rps == pytest.approx(300 / 120)  # median of 2.0, 2.5, 2.73
    assert found.p99 == pytest.approx(0.4)  # median of 0.8, 0.4, 0.4
    low = versus_best(results, "minilm-1", 1, by_latency=True)
    assert low is not None and low.p50 == pytest.approx(0.5)
    verdicts = {row[0].split(" (")[0]: (row[3], row[4]) for row in peer_targets(results, 32)}
    assert verdicts["minilm-1 c=32: throughput vs best peer"] == ("**met**", "")
    assert verdicts["minilm-1 c=32: p99 vs best peer's"] == ("**met**", "")
    assert verdicts["minilm-1 c=1: p50 vs best peer's"] == ("**met**", "")
    assert verdicts["digits c=32: throughput vs PyTriton"] == ("**met**", "")
    assert verdicts["digits c=32: throughput vs HTTP ceiling"][0] == "**not met**"
    assert verdicts["digits c=32: throughput vs HTTP ceiling"][1] == "at 0.95 of the target"
    assert verdicts["minilm-8 c=32: throughput vs best peer"] == ("–", "not measured")
    assert verdicts["digits c=32: nograd p99"] == ("**met**", "")
    text = markdown(results)
    # The report leads with the real peers: their section is the first after the header.
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections[0].startswith("## nograd against the real peers")
    assert "| minilm-1 | 32 | pytriton | 2.50 | 0.50 | 0.40 | 3 |" in text


def test_a_peers_best_configuration_is_the_fastest_that_failed_nothing() -> None:
    from bench.phases.peers import _best

    def row(label: str, rps: float, errors: int) -> dict[str, Any]:
        return {"system": "pytriton", "workload": "minilm-1", "label": label} | {
            "rps": rps,
            "errors": errors,
        }

    best = _best([row("16", 200.0, 0), row("64", 400.0, 12), row("32", 250.0, 0)])
    assert best[("pytriton", "minilm-1")]["label"] == "32"


def test_a_server_that_cannot_be_paused_is_left_running() -> None:
    from bench.common import Server

    server = Server("sleeper", [sys.executable, "-c", "import time; time.sleep(30)"], "/")
    server.pausable = False
    server.process = subprocess.Popen(server.command, start_new_session=True)
    try:
        server.pause()
        time.sleep(0.2)
        state = Path(f"/proc/{server.process.pid}/stat").read_text().split()[2]
        assert state != "T"  # not stopped
    finally:
        server.process.kill()
        server.process.wait()


def test_a_run_of_other_phases_renders_no_empty_closed_loop_tables() -> None:
    """A run of the processes phase alone (or any phase without headline runs) shows no
    targets, closed-loop, ratio or sweep table with nothing in it."""
    text = markdown(results_with([]))
    for title in (
        "## Targets (issue 5)",
        "## Closed loop",
        "### nograd throughput ratios",
        "## Every closed-loop run",
    ):
        assert title not in text
