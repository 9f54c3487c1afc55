"""The engine choice: candidates, the accuracy guard on engines, and auto picking by measurement
(scripted timings, so the choice is checked without depending on this machine's speed)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from nograd.runtime.engines import choice, remembered
from nograd.runtime.engines.choice import (
    EngineResult,
    candidates,
    prepare_engine,
    ranges,
    tolerance_for,
)
from nograd.runtime.engines.onnx import OnnxPath
from nograd.runtime.engines.paths import EnginePath, RangePath, share_cores
from nograd.runtime.handler import TorchRunner
from nograd.runtime.speed.guard import SpeedCheck
from nograd.schema.config import ConfigError, load_config
from tests.unit.runtime.engines.tiny import tiny_folder, tiny_handler

LIMIT = 32


def scripted(*per_engine: Sequence[float]) -> object:
    """``time_parts`` returning the given seconds per timing batch, one call after another."""
    calls = iter(per_engine)

    def fake(runner: TorchRunner, batches: Sequence[object], passes: int = 3) -> tuple[float, ...]:
        return tuple(next(calls))[: len(batches)]

    return fake


def run_tiny(handler: object, *inputs: np.ndarray) -> list[np.ndarray]:
    from nograd.runtime.handler import ModelHandler

    assert isinstance(handler, ModelHandler)
    parts = [handler.prepare({"x": array}) for array in inputs]
    return [out["scores"] for out in TorchRunner(handler).run_batch(parts)]


def test_candidates_follow_engine_engines_and_precision(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = load_config(folder / "config.toml", override={"engine": "auto"})
    assert candidates(auto, cpu) == ["onnx"]
    aoti = load_config(
        folder / "config.toml", override={"engine": "auto", "engines": ["eager", "onnx", "aoti"]}
    )
    assert candidates(aoti, cpu) == ["onnx", "aoti"]
    int8 = load_config(folder / "config.toml", override={"engine": "auto", "precision": "int8"})
    assert candidates(int8, cpu) == ["onnx-int8", "onnx"]
    assert candidates(int8, cuda) == ["onnx"]
    only = load_config(folder / "config.toml", override={"engine": "onnx", "precision": "int8"})
    assert candidates(only, cpu) == ["onnx-int8"]
    assert tolerance_for("onnx-int8", only) == float("inf")
    assert tolerance_for("onnx", auto) == pytest.approx(1e-4)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"precision": "int8"}, "precision"),
        ({"engine": "auto", "engines": ["onnx", "onnx"]}, "engines"),
        ({"format": "onnx"}, "artifact"),
        ({"artifact": "model.onnx"}, "artifact"),
        ({"format": "onnx", "artifact": "m.onnx", "engine": "aoti"}, "engine"),
        ({"format": "aoti", "artifact": "m.pt2", "inputs": []}, "inputs"),
        ({"format": "onnx", "artifact": "../m.onnx"}, "artifact"),
        ({"format": "onnx", "artifact": "m.onnx", "artifact_sha256": "abc"}, "artifact_sha256"),
    ],
)
def test_engine_fields_refused_naming_the_field(
    tmp_path: Path, override: dict[str, object], field: str
) -> None:
    folder = tiny_folder(tmp_path)
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        load_config(folder / "config.toml", override=override)


def test_ranges_merge_neighbours_with_the_same_winner() -> None:
    assert ranges((1, 8, 32), ["onnx", "onnx", "eager"]) == ((8, "onnx"), (32, "eager"))
    assert ranges((1, 8), ["eager", "eager"]) == ((8, "eager"),)


def test_auto_serves_the_fastest_engine_per_batch_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    handler = tiny_handler(tmp_path, 'engine = "auto"')
    x = np.random.default_rng(3).random((5, 16), dtype=np.float32)
    eager_scores = run_tiny(handler, x)[0]
    # Timing batches: rows 1, 8, 32. ONNX wins at 1 and 8, eager at 32.
    monkeypatch.setattr(choice, "time_parts", scripted((1.0, 2.0, 3.0), (0.5, 1.0, 3.5)))
    checks: list[SpeedCheck] = []
    with caplog.at_level(logging.INFO, logger="nograd.runtime.engines.choice"):
        served = prepare_engine(handler, LIMIT, None, checks.append, [], tmp_path / "cache")
    assert isinstance(served.speed_path, RangePath)
    assert served.speed_mode == "onnx<=8,eager"
    assert [(most, type(path).__name__) for most, path in served.speed_path.ranges] == [
        (8, "OnnxPath"),
        (32, "EagerPath"),
    ]
    assert np.allclose(run_tiny(served, x)[0], eager_scores, atol=1e-5)
    # Taking turns with eager torch, ONNX Runtime's threads sleep after each run.
    assert spinning(served.speed_path.ranges[0][1]) == "0"
    assert [check.mode for check in checks] == ["onnx"]
    assert checks[0].speed is not None and checks[0].speed.speedup == pytest.approx(6 / 5)
    assert "serving onnx<=8,eager" in caplog.text
    assert list((tmp_path / "cache").glob("tiny-v1-onnx-*.onnx"))


def spinning(path: object) -> str:
    """The session's ``allow_spinning`` entry, "1" when its threads busy-wait after a run."""
    assert isinstance(path, OnnxPath)
    options = path.session.get_session_options()
    return str(options.get_session_config_entry("session.intra_op.allow_spinning"))


def test_auto_keeps_eager_when_no_engine_is_faster_by_the_margin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = tiny_handler(tmp_path, 'engine = "auto"')
    monkeypatch.setattr(choice, "time_parts", scripted((1.0, 2.0, 3.0), (0.99, 1.98, 2.97)))
    served = prepare_engine(handler, LIMIT, None, None, [], tmp_path / "cache")
    assert served.speed_path is None
    assert served.speed_mode == "fp32"


def test_a_load_of_the_same_files_serves_the_remembered_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(choice, "time_parts", scripted((1.0, 1.0, 1.0), (0.5, 0.5, 0.5)))
    first = prepare_engine(
        tiny_handler(tmp_path, 'engine = "onnx"'), LIMIT, None, None, [], tmp_path / "cache"
    )
    assert first.speed_mode == "onnx"

    def no_export(*args: object) -> object:
        raise AssertionError("a remembered choice exports nothing")

    monkeypatch.setattr(choice, "export_program", no_export)
    again = prepare_engine(
        tiny_handler(tmp_path, 'engine = "onnx"'), LIMIT, None, None, [], tmp_path / "cache"
    )
    assert isinstance(again.speed_path, EnginePath) and again.speed_mode == "onnx"
    # Other weights are another model: measured again, which needs an export (refused here,
    # so eager serves it).
    changed = tiny_handler(tmp_path, 'engine = "onnx"')
    with torch.no_grad():
        next(changed.module.parameters()).add_(1.0)
    monkeypatch.setattr(choice, "time_parts", scripted((1.0, 1.0, 1.0)))
    measured = prepare_engine(changed, LIMIT, None, None, [], tmp_path / "cache")
    assert measured.speed_path is None


def test_a_load_hashes_the_weights_once_for_its_profile_and_its_engine_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = tiny_handler(tmp_path, 'engine = "onnx"')
    digest = remembered.model_digest(handler, LIMIT, [])
    assert remembered.choice_key(handler, LIMIT, [], digest) == remembered.choice_key(
        handler, LIMIT, []
    )
    assert remembered.keyed(digest, ()) != remembered.choice_key(handler, LIMIT, [])

    def hashed_again(*args: object) -> str:
        raise AssertionError("the weights were hashed again")

    monkeypatch.setattr(remembered, "model_digest", hashed_again)
    monkeypatch.setattr(choice, "time_parts", scripted((1.0, 1.0, 1.0), (0.5, 0.5, 0.5)))
    served = prepare_engine(handler, LIMIT, None, None, [], tmp_path / "cache", digest=digest)
    assert served.speed_mode == "onnx"


def test_an_engine_named_alone_is_refused_when_slower(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = tiny_handler(tmp_path, 'engine = "onnx"')
    monkeypatch.setattr(choice, "time_parts", scripted((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)))
    served = prepare_engine(handler, LIMIT, None, None, [], tmp_path / "cache")
    assert served.speed_path is None
    monkeypatch.setattr(choice, "time_parts", scripted((1.0, 1.0, 1.0), (0.5, 0.5, 0.5)))
    handler = tiny_handler(tmp_path, 'engine = "onnx"')
    # A cache of its own: the first cache remembers the choice measured above for these files.
    served = prepare_engine(handler, LIMIT, None, None, [], tmp_path / "cache-faster")
    assert isinstance(served.speed_path, EnginePath) and served.speed_mode == "onnx"
    # ONNX Runtime runs every batch: its threads keep ONNX Runtime's default spinning.
    assert spinning(served.speed_path) == "1"
    # Eager serves no batch: its weights are let go.
    assert served.module is None and served.weights_bytes == 0


class _Broken(EnginePath):
    """A real engine whose scores are off by 0.1: a wrong artifact."""

    def __init__(self, inner: EnginePath) -> None:
        super().__init__(inner.inputs, inner.outputs)
        self.name = inner.name
        self._inner = inner

    def check_inputs(self, handler: object) -> None:
        pass

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        out = dict(self._inner.forward(batch))
        out["scores"] = out["scores"] + 0.1
        return out


def refusals(caplog: pytest.LogCaptureFixture) -> dict[str, str]:
    """Engine -> why it was refused, from the rows of the logged table of engines."""
    (record,) = [r for r in caplog.records if "engines measured at load" in r.getMessage()]
    return {row["engine"]: row["refused"] for row in record.table if row["refused"]}


def test_a_wrong_engine_is_refused_and_eager_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = choice.build_engine
    monkeypatch.setattr(choice, "build_engine", lambda *args: _Broken(real(*args)))
    monkeypatch.setattr(choice, "time_parts", scripted((1.0, 1.0, 1.0)))
    handler = tiny_handler(tmp_path, 'engine = "auto"')
    with caplog.at_level(logging.INFO, logger="nograd.runtime.engines.choice"):
        served = prepare_engine(handler, LIMIT, None, None, [], tmp_path / "cache")
    assert served.speed_path is None
    reason = "output 'scores' max abs error 0.1 exceeds accuracy_tolerance"
    assert reason in refusals(caplog)["onnx"]


def test_an_engine_that_cannot_be_built_is_refused_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_runtime(*args: object) -> EnginePath:
        raise ImportError("no onnxruntime here")

    monkeypatch.setattr(choice, "build_engine", no_runtime)
    monkeypatch.setattr(choice, "time_parts", scripted((1.0, 1.0, 1.0)))
    handler = tiny_handler(tmp_path, 'engine = "auto"')
    with caplog.at_level(logging.INFO, logger="nograd.runtime.engines.choice"):
        served = prepare_engine(handler, LIMIT, None, None, [], tmp_path / "cache")
    assert served.speed_path is None
    assert refusals(caplog)["onnx"] == "ImportError: no onnxruntime here"


def test_labels_below_min_match_rate_refuse_an_engine() -> None:
    from nograd.runtime.speed.accuracy import compare

    reference = [{"label": np.array([[1], [2], [3], [4]])}]
    candidate = [{"label": np.array([[1], [2], [3], [0]])}]
    report = compare(reference, candidate)
    assert report.problems(1e-4, 0.999, 0.9) == [
        "output 'label' matches fp32 eager in 75.0% of elements, under min_match_rate 90.0%"
    ]
    assert report.problems(1e-4, 0.999, None) == []


def test_engine_results_are_logged_as_table_rows() -> None:
    table = choice.EngineTable(
        "m",
        (1, 32),
        EngineResult("eager", seconds=(0.001, 0.01)),
        (EngineResult("onnx", seconds=(0.0005, 0.02)), EngineResult("aoti", refused="boom")),
        ((1, "onnx"), (32, "eager")),
    )
    eager, onnx, aoti = table.log_rows()
    assert eager == {
        "engine": "eager",
        "max_abs_error": None,
        "min_cosine": None,
        "rows_1_ms": 1.0,
        "rows_32_ms": 10.0,
        "refused": None,
    }
    assert (onnx["rows_1_ms"], onnx["rows_32_ms"]) == (0.5, 20.0)
    assert aoti["refused"] == "boom" and "rows_1_ms" not in aoti
    assert table.label == "onnx<=1,eager"


def test_workers_sharing_cores_run_onnx_at_the_width_each_batch_is_granted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = tiny_handler(tmp_path, 'engine = "onnx"')
    monkeypatch.setattr(choice, "time_parts", scripted((1.0, 1.0, 1.0), (0.5, 0.5, 0.5)))
    served = prepare_engine(handler, LIMIT, None, None, [], tmp_path / "cache")
    path = served.speed_path
    assert isinstance(path, OnnxPath)
    share_cores(path, (1, 2))
    before = torch.get_num_threads()
    try:
        for width in (1, 2):
            torch.set_num_threads(width)
            options = path.session.get_session_options()
            assert options.intra_op_num_threads == width
            assert spinning(path) == "0"  # another worker's batch may need the core
        assert len(path._sessions) == 2  # opened at load, not under traffic
    finally:
        torch.set_num_threads(before)
