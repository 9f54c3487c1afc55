"""The memory profile remembered in the engine cache: a second load of the same files plans from
the record, and a change to what the profile depends on profiles again."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nograd.runtime import remembered_profile
from nograd.runtime.engines import choice
from nograd.runtime.engines.choice import prepare_engine
from nograd.runtime.engines.remembered import model_key
from nograd.runtime.handler import ModelHandler
from nograd.runtime.memory import CpuMemoryProbe
from nograd.runtime.memory.fits import RangedCost, Verdict
from nograd.runtime.planner import profile_handler
from nograd.runtime.remembered_profile import cost_document, cost_from, profile_or_recall
from tests.unit.runtime.engines.test_choice import scripted
from tests.unit.runtime.engines.tiny import tiny_folder, tiny_handler

CAP = 32


class ProfileSpy:
    """``profile_handler`` counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(
        self,
        handler: ModelHandler,
        probe: CpuMemoryProbe,
        cap: int,
        stop: Callable[[], bool] | None = None,
    ) -> RangedCost:
        self.calls += 1
        return profile_handler(handler, probe, cap, stop)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> ProfileSpy:
    counting = ProfileSpy()
    monkeypatch.setattr(remembered_profile, "profile_handler", counting)
    return counting


def profile(handler: ModelHandler, code: list[Path], cache: Path, cap: int = CAP) -> RangedCost:
    """As a load plans it: the model's key taken first, then its profile remembered or made."""
    loaded_as = model_key(handler, cap, code, ())
    return profile_or_recall(handler, CpuMemoryProbe(), cap, loaded_as, cache)


def load(root: Path, cache: Path, cap: int = CAP) -> RangedCost:
    return profile(tiny_handler(root), [tiny_folder(root) / "model.py"], cache, cap)


def test_a_second_load_plans_from_the_record_without_profiling(
    tmp_path: Path, spy: ProfileSpy, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    first = load(tmp_path, cache)
    assert spy.calls == 1
    with caplog.at_level(logging.INFO, remembered_profile.__name__):
        again = load(tmp_path, cache)
    assert spy.calls == 1
    assert again == first
    assert "memory profile as measured at an earlier load" in caplog.text


def test_changed_weights_code_or_cap_profile_again(tmp_path: Path, spy: ProfileSpy) -> None:
    cache = tmp_path / "cache"
    load(tmp_path, cache)
    changed = tiny_handler(tmp_path)
    with torch.no_grad():
        next(changed.module.parameters()).add_(1.0)
    code = [tiny_folder(tmp_path) / "model.py"]
    profile(changed, code, cache)
    assert spy.calls == 2
    load(tmp_path, cache, cap=CAP // 2)
    assert spy.calls == 3
    handler = tiny_handler(tmp_path)
    code[0].write_text(code[0].read_text() + "\n# another revision\n")
    profile(handler, code, cache)
    assert spy.calls == 4


def test_a_record_of_another_layout_or_unreadable_is_profiled_again(
    tmp_path: Path, spy: ProfileSpy
) -> None:
    cache = tmp_path / "cache"
    load(tmp_path, cache)
    (record,) = cache.glob("tiny-v1-profile-*.json")
    record.write_text(record.read_text().replace('"format": 1', '"format": 0'))
    load(tmp_path, cache)
    assert spy.calls == 2
    record.write_text('{"format": 1, "ranges": [{"engine": "eager"}]}')
    load(tmp_path, cache)
    assert spy.calls == 3
    # Profiled again, the record is whole once more.
    load(tmp_path, cache)
    assert spy.calls == 3


def test_the_record_round_trips_every_fit(tmp_path: Path) -> None:
    cost = profile_handler(tiny_handler(tmp_path), CpuMemoryProbe(), CAP)
    assert cost_from(cost_document(cost)) == cost


def test_a_model_without_a_key_is_profiled_every_time(tmp_path: Path, spy: ProfileSpy) -> None:
    handler = tiny_handler(tmp_path)
    for _ in range(2):
        profile_or_recall(handler, CpuMemoryProbe(), CAP, "", tmp_path / "cache")
    assert spy.calls == 2
    assert not (tmp_path / "cache").exists()


def test_a_model_whose_engine_serves_every_batch_is_remembered(
    tmp_path: Path, spy: ProfileSpy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its eager weights are gone once the engine serves: the key taken before still holds."""
    monkeypatch.setattr(choice, "time_parts", scripted((1.0, 1.0, 1.0), (0.5, 0.5, 0.5)))
    cache = tmp_path / "cache"
    code = [tiny_folder(tmp_path, 'engine = "onnx"') / "model.py"]
    for _ in range(2):
        handler = tiny_handler(tmp_path, 'engine = "onnx"')
        loaded_as = model_key(handler, CAP, code, ())
        handler = prepare_engine(handler, CAP, None, None, code, cache)
        assert handler.module is None and handler.speed_mode == "onnx"
        profile_or_recall(handler, CpuMemoryProbe(), CAP, loaded_as, cache)
    assert spy.calls == 1


def refused_copy(cost: RangedCost) -> RangedCost:
    """``cost`` with its first range's fit refused, as a disturbed measurement leaves it."""
    first = cost.ranges[0]
    refused = dataclasses.replace(
        first, fit=dataclasses.replace(first.fit, verdict=Verdict.REFUSED)
    )
    return RangedCost((refused, *cost.ranges[1:]))


def test_a_refused_fit_is_never_remembered(
    tmp_path: Path, spy: ProfileSpy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A measurement whose check failed (another process's work disturbed it) is measured again
    at the next load, never served from the record for good."""
    measured = spy

    def disturbed(*args: Any, **kwargs: Any) -> RangedCost:
        return refused_copy(measured(*args, **kwargs))

    monkeypatch.setattr(remembered_profile, "profile_handler", disturbed)
    cache = tmp_path / "cache"
    load(tmp_path, cache)
    assert not list(cache.glob("tiny-v1-profile-*.json"))
    load(tmp_path, cache)
    assert spy.calls == 2


def test_a_refused_record_is_measured_again(tmp_path: Path, spy: ProfileSpy) -> None:
    cache = tmp_path / "cache"
    cost = load(tmp_path, cache)
    (record,) = cache.glob("tiny-v1-profile-*.json")
    document = json.loads(record.read_text())
    document["ranges"] = cost_document(refused_copy(cost))
    record.write_text(json.dumps(document))
    load(tmp_path, cache)
    assert spy.calls == 2
