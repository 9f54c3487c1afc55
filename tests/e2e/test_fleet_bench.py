"""The fleet phase of ``make bench`` end to end on a small repository (6 ONNX models of 1 MiB,
3 s per balance, one round): both fleets answer every model from the model asked, the rolling
restart and the scale to 4 replicas under its clients fail no request, and the scale moves
models only onto the new replica. Slow: it starts four fleets' worth of replicas."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from bench.phases.fleet import SCALED_REPLICAS, measure_fleet
from tests.prometheus_tools import haproxy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODELS = 6


def test_the_fleet_phase_measures_both_balances_a_restart_and_a_scale(tmp_path: Path) -> None:
    haproxy()
    record = measure_fleet(tmp_path, models=MODELS, weights_mib=1, limit_mib=64, seconds=3.0)
    orjson.dumps(record)  # the run's JSON result holds it as it is
    assert sorted(run["balance"] for run in record["runs"]) == ["model", "roundrobin"]
    for run in record["runs"]:
        assert run["models_answered"] == MODELS, run
        assert run["wrong"] == 0 and run["failed"] == 0, run
        assert run["answered"] > 0 and run["loads"] >= 1, run
        held = run["placement"]
        assert sorted(held) == ["1", "2", "3"], held
        assert {name for one in held.values() for name in one["resident"]} <= {
            f"m{index}" for index in range(MODELS)
        }
    assert record["ratios"]["requests"][0] is not None
    for change in (record["rolling_restart"], record["scale"]):
        assert change["failed"] == 0 and change["wrong"] == 0, change
        assert change["answered"] > 0, change
    before, after = record["scale"]["homes_before"], record["scale"]["homes_after"]
    assert {after[name] for name in before if after[name] != before[name]} <= {SCALED_REPLICAS}
    assert record["scale"]["moved_share"] < 1.0
