"""Max-min fair shares of a device budget: minimums first, then water-filling up to each cap."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace
from typing import cast

import pytest

from nograd.runtime.handler import ModelHandler
from nograd.runtime.memory import (
    CostModel,
    CpuMemoryProbe,
    batch_limit,
    share_budget,
)
from nograd.runtime.memory.budget import Demand
from nograd.runtime.planner import PlanInput, log_plan, plan_device
from tests.unit.runtime.memory.conftest import one_engine

KIB = 1024


def test_the_reported_case_digits_gets_rows_and_minilm_none() -> None:
    # Two workers sharing 256 KiB: 128 KiB each. One MiniLM sequence needs more than that;
    # a digits sample needs 16.5 KiB, so digits gets the whole budget and several rows.
    budget = 128 * KIB
    digits = CostModel(fixed=300, per_unit=16.5 * KIB)
    minilm_one_sequence = 3 * 2**20
    demands = {
        "digits": Demand(minimum=int(digits.predict(1)) + 1, at_cap=int(digits.predict(64)) + 1),
        "minilm": Demand(minimum=minilm_one_sequence, at_cap=40 * minilm_one_sequence),
    }
    shares = share_budget(budget, demands)
    assert shares["minilm"] == 0
    assert shares["digits"] == budget
    assert batch_limit(digits, shares["digits"], max_batch_size=64) == 7


def test_a_budget_that_fits_everyone_at_their_caps() -> None:
    demands = {"a": Demand(10, 100), "b": Demand(20, 300), "c": Demand(0, 0)}
    # Each gets what it uses at its cap; the 600 bytes left over no model could use.
    assert share_budget(1000, demands) == {"a": 100, "b": 300, "c": 0}


def test_water_filling_gives_what_a_small_model_cannot_use_to_the_others() -> None:
    demands = {"small": Demand(10, 100), "big": Demand(10, 10_000), "huge": Demand(10, 50_000)}
    shares = share_budget(1000, demands)
    # An even split would be 333 each; "small" stops at 100, the other two share the rest.
    assert shares == {"small": 100, "big": 450, "huge": 450}


def test_minimums_are_guaranteed_before_the_level_rises() -> None:
    demands = {"wide": Demand(700, 5000), "narrow": Demand(10, 5000)}
    shares = share_budget(1000, demands)
    assert shares == {"wide": 700, "narrow": 300}


def test_models_whose_minimums_do_not_fit_together_leave_the_larger_out() -> None:
    # Each minimum fits the budget alone, but only two fit together: the smallest two get in
    # (the most models served) and share the whole budget.
    demands = {"a": Demand(400, 2000), "b": Demand(500, 2000), "c": Demand(300, 2000)}
    assert share_budget(1000, demands) == {"a": 500, "b": 0, "c": 500}


def test_nothing_to_share() -> None:
    assert share_budget(0, {"a": Demand(1, 10)}) == {"a": 0}
    assert share_budget(0, {"free": Demand(0, 0)}) == {"free": 0}
    assert share_budget(100, {}) == {}
    with pytest.raises(ValueError):
        share_budget(-1, {})
    with pytest.raises(ValueError):
        Demand(minimum=10, at_cap=5)


@pytest.mark.parametrize("seed", range(200))
def test_random_shares_are_max_min_fair_and_within_the_budget(seed: int) -> None:
    rng = random.Random(seed)
    demands: dict[str, Demand] = {}
    for index in range(rng.randint(1, 6)):
        minimum = rng.choice([0, rng.randint(1, 10_000), rng.randint(1, 10**9)])
        demands[f"m{index}"] = Demand(minimum, minimum + rng.randint(0, 10**6))
    budget = rng.choice([0, rng.randint(0, 20_000), rng.randint(0, 10**7), 10**10])
    shares = share_budget(budget, demands)
    assert set(shares) == set(demands)
    assert sum(shares.values()) <= budget
    admitted = {name for name, share in shares.items() if share >= demands[name].minimum}
    left_out = set(demands) - admitted
    assert all(shares[name] == 0 for name in left_out)
    # Nobody is left out while a smaller minimum got in, or while its minimum fits what is left.
    reserved = sum(demands[name].minimum for name in admitted)
    for name in left_out:
        assert demands[name].minimum > budget - reserved
        assert all(demands[name].minimum >= demands[other].minimum for other in admitted)
    if not admitted:
        return
    assert all(shares[name] <= demands[name].at_cap for name in demands)
    if all(shares[name] == demands[name].at_cap for name in admitted):
        return
    # Below every cap the budget is spent to the byte, and no share is more than one byte
    # above another's unless it is held there by its minimum.
    assert sum(shares.values()) == budget
    for name in admitted:
        if shares[name] < demands[name].at_cap:
            for other in admitted:
                assert shares[other] <= shares[name] + 1 or shares[other] == demands[other].minimum


def test_the_plan_leaves_out_a_model_that_fits_only_alone_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def handler(unit: str, max_length: int | None = None) -> ModelHandler:
        stub = SimpleNamespace(config=SimpleNamespace(batch_unit=unit), max_length=max_length)
        return cast(ModelHandler, stub)

    inputs = [
        PlanInput("images", handler("samples"), 0, cap=64),
        PlanInput("text", handler("tokens", max_length=128), 0, cap=4096),
    ]
    profiles = {
        "images": one_engine(CostModel(fixed=0, per_unit=600)),
        # One sequence of 128 tokens: 128 * 5 = 640 bytes, within 1000 alone, not beside images.
        "text": one_engine(CostModel(fixed=0, per_unit=5)),
    }
    budget, plans = plan_device(
        inputs, profiles, CpuMemoryProbe(), fraction=0.9, explicit_bytes=1000
    )
    by_name = {plan.name: plan for plan in plans}
    assert by_name["images"].limit == 1 and by_name["images"].share_bytes == 1000
    assert by_name["text"].limit == 0 and by_name["text"].minimum_bytes == 640
    with caplog.at_level(logging.WARNING, logger="nograd.runtime.planner"):
        log_plan("cpu", budget, plans)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("model text: its smallest batch (one sequence of 128 tokens)")
    assert "640 B" in warning and "1000 B budget" in warning and "beside" in warning
