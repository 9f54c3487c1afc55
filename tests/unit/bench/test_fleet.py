"""The fleet phase's arithmetic and report without a fleet: the paired ratios and their targets,
the share of homes a scale moved, the order of each round, what the clients' record says, and
the section that renders it."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench.phases.fleet import (
    FleetRun,
    Traffic,
    moved_share,
    ratios,
    round_order,
    zipf_popularity,
)
from bench.phases.residency import generated_models_env
from bench.plan import FLEET_ROUNDS, FLEET_SECONDS, Plan
from bench.report.fleet import fleet_section
from bench.run import command_line


def _run(round_: int, balance: str, answered: int, loads: float) -> dict[str, Any]:
    per_answer = loads / answered if answered else None
    return {
        "round": round_,
        "balance": balance,
        "answered": answered,
        "loads": loads,
        "loads_per_answer": per_answer,
    }


def test_ratios_pair_each_round_and_take_the_median() -> None:
    runs = [
        _run(0, "roundrobin", 100, 200.0),
        _run(0, "model", 300, 20.0),
        _run(1, "model", 150, 30.0),
        _run(1, "roundrobin", 100, 100.0),
        _run(2, "model", 500, 10.0),
        _run(2, "roundrobin", 100, 100.0),
    ]
    found = ratios(runs)
    assert found["requests"] == [3.0, 1.5, 5.0]
    assert found["loads"] == [0.1, 0.3, 0.1]
    assert found["requests_median"] == 3.0
    assert found["loads_median"] == 0.1
    assert found["loads_per_answer"] == pytest.approx([1 / 30, 0.2, 0.02])
    assert found["requests_met"] and found["loads_met"]


def test_ratios_miss_the_targets_and_skip_a_round_missing_a_balance() -> None:
    runs = [
        _run(0, "model", 150, 30.0),
        _run(0, "roundrobin", 100, 100.0),
        _run(1, "model", 900, 1.0),  # its round robin run never came: no pair
    ]
    found = ratios(runs)
    assert found["requests"] == [1.5]
    assert found["loads_median"] == 0.3
    assert not found["requests_met"] and not found["loads_met"]


def test_a_round_robin_run_that_answered_nothing_has_no_ratio() -> None:
    found = ratios([_run(0, "model", 10, 0.0), _run(0, "roundrobin", 0, 0.0)])
    assert found["requests"] == [None] and found["requests_median"] is None
    assert not found["requests_met"]


def test_moved_share_counts_models_with_another_home() -> None:
    before = {"m0": 1, "m1": 2, "m2": 3, "m3": 1}
    assert moved_share(before, dict(before)) == 0.0
    assert moved_share(before, {**before, "m1": 4}) == 0.25


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_rounds_alternate_and_the_last_ends_on_model_aware_balancing(rounds: int) -> None:
    orders = [round_order(index, rounds) for index in range(rounds)]
    assert orders[-1][-1] == "model"
    assert all(sorted(order) == ["model", "roundrobin"] for order in orders)
    assert all(a != b for a, b in itertools.pairwise(orders))


def test_zipf_popularity_falls_with_rank() -> None:
    weights = zipf_popularity(24)
    assert len(weights) == 24 and weights[0] == 1.0
    assert all(a > b for a, b in itertools.pairwise(weights))


def test_the_summary_counts_failures_by_kind_and_percentiles_of_the_answered() -> None:
    traffic = Traffic(
        answers=[(0.1 * n, 0.01 * n) for n in range(1, 101)],
        failed=Counter({"503": 2, "RemoteProtocolError": 1}),
        wrong=["m1: {...}"],
        models_answered={"m0", "m1"},
        seconds=10.0,
    )
    summary = traffic.summary()
    assert summary["answered"] == 100 and summary["rps"] == 10.0
    assert summary["failed"] == 3 and summary["failures"]["503"] == 2
    assert summary["wrong"] == 1 and summary["models_answered"] == 2
    assert summary["p50_ms"] == pytest.approx(505.0)
    assert summary["p99_ms"] == pytest.approx(1000.0)


def test_requests_answered_after_the_window_do_not_count() -> None:
    traffic = Traffic(answers=[(1.0, 0.5), (4.9, 0.5), (5.5, 3.0)], seconds=5.5)
    summary = traffic.summary(5.0)
    assert summary["answered"] == 2 and summary["rps"] == 0.4 and summary["seconds"] == 5.0
    assert summary["p99_ms"] == 500.0


def test_the_plan_takes_the_fleets_seconds_and_rounds() -> None:
    plan = Plan.from_args(command_line().parse_args(["--phases", "fleet"]))
    assert (plan.fleet_seconds, plan.fleet_rounds) == (FLEET_SECONDS, FLEET_ROUNDS)
    args = ["--phases", "fleet", "--fleet-seconds", "15", "--fleet-rounds", "3"]
    plan = Plan.from_args(command_line().parse_args(args))
    assert (plan.fleet_seconds, plan.fleet_rounds) == (15.0, 3)


def test_the_section_shows_each_run_the_ratios_and_the_changes() -> None:
    run = {"answered": 300, "rps": 5.0, "p50_ms": 40.0, "p99_ms": 900.0, "models_answered": 24}
    record = {
        "replicas": 3,
        "scaled_replicas": 4,
        "limit_mib": 256,
        "models": 24,
        "weights_mib": 32,
        "clients": 8,
        "zipf_exponent": 1.1,
        "seconds": 60.0,
        "rounds": 1,
        "runs": [
            {**run, "round": 0, "balance": "roundrobin", "loads": 200.0, "wrong": 0, "failed": 0},
            {**run, "round": 0, "balance": "model", "answered": 900, "loads": 24.0, "wrong": 0}
            | {"failed": 2, "failures": {"503": 2}, "loads_second_half": 3.0}
            | {"placement": {"1": {"resident": ["m0", "m3"], "used_mib": 70.0, "model_mib": 35.0}}},
        ],
        "ratios": ratios(
            [_run(0, "roundrobin", 300, 200.0), _run(0, "model", 900, 24.0)],
        ),
        "rolling_restart": {"command_s": 30.0, "answered": 80, "p99_ms": 2000.0, "wrong": 0}
        | {"failed": 0},
        "scale": {"command_s": 10.0, "answered": 40, "p99_ms": 1500.0, "wrong": 0}
        | {"failed": 0, "moved_share": 0.25},
    }
    text = "\n".join(fleet_section({"fleet": record}, "2 cores"))
    assert "NOGRAD_MEMORY_LIMIT_BYTES=256MiB" in text
    assert "| 1 | model | 900 | 5.0 | 40.0 | 900 | 24.0 | 3.0 | 24/24 | 0 | 2 (503: 2) |" in text
    assert "Resident at the end of round 1, model: replica 1: 2 models, 70.0 MiB." in text
    assert "3.00x (meets ≥ 2x) the requests answered" in text
    assert "0.12x (meets ≤ 0.25x) the cold loads (0.04x the loads per request answered)" in text
    assert "| `nograd fleet rolling-restart` | 30.0 | 80 | 2,000 | 0 | 0 | – |" in text
    assert "| `nograd fleet scale --replicas 4` | 10.0 | 40 | 1,500 | 0 | 0 | 25 % |" in text
    assert fleet_section({}, "2 cores") == []


def test_the_generated_models_engine_cache_stays_in_the_runs_folder(tmp_path: Path) -> None:
    """The mapped forms of a run's generated ONNX models go beside them, never into the user's
    engine cache (a new set per run otherwise)."""
    repository = tmp_path / "run" / "onnx-24x32MiB"
    fleet = FleetRun(repository, tmp_path / "state", 256)
    assert fleet.env()["NOGRAD_ENGINE_CACHE"] == str(tmp_path / "run" / "engines")
    one_server = generated_models_env(repository, 256)
    assert one_server["NOGRAD_ENGINE_CACHE"] == str(tmp_path / "run" / "engines")
    assert one_server["NOGRAD_MEMORY_LIMIT_BYTES"] == "256MiB"
