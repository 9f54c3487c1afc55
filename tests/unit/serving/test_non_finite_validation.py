"""NaN and +/-Inf in floating-point inputs are refused (400, naming the input) unless the model's
``reject_non_finite`` is off; other datatypes are never checked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nograd.schema.config import ModelConfig
from nograd.serving.calls.validation import validate
from nograd.serving.errors import InvalidInput
from nograd.serving.registry import ServedModel


def served(tmp_path: Path, datatype: str = "FP32", **options: object) -> ServedModel:
    config = ModelConfig.model_validate(
        {
            "name": "m",
            "weights": "",
            "inputs": [
                {"name": "x", "datatype": datatype, "shape": [3]},
                {"name": "ids", "datatype": "INT64", "shape": [3]},
            ],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}],
            **options,
        }
    )
    return ServedModel(config, tmp_path)


def check(model: ServedModel, x: np.ndarray) -> None:
    ids = np.zeros((len(x), 3), dtype=np.int64)
    validate(model, {"x": x, "ids": ids}, max_rows=64, max_text_bytes=1024)


@pytest.mark.parametrize(("bad", "shown"), [(np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf")])
def test_a_non_finite_fp32_value_is_refused_naming_the_input_and_where(
    tmp_path: Path, bad: float, shown: str
) -> None:
    x = np.ones((2, 3), dtype=np.float32)
    x[1, 2] = bad
    with pytest.raises(InvalidInput) as refused:
        check(served(tmp_path), x)
    message = str(refused.value)
    assert "input 'x' holds 1 non-finite value " in message
    assert f"the first {shown} at index [1, 2]" in message
    assert "model 'm'" in message and "reject_non_finite" in message


def test_the_message_counts_every_non_finite_value_and_shows_the_first(tmp_path: Path) -> None:
    x = np.ones((3, 3), dtype=np.float32)
    x[0, 1], x[2, 0], x[2, 2] = np.inf, np.nan, -np.inf
    with pytest.raises(
        InvalidInput, match=r"holds 3 non-finite values .* first inf at index \[0, 1\]"
    ):
        check(served(tmp_path), x)


@pytest.mark.parametrize("datatype", ["FP16", "FP64"])
def test_every_float_width_is_checked(tmp_path: Path, datatype: str) -> None:
    x = np.zeros((1, 3), dtype=np.float16 if datatype == "FP16" else np.float64)
    x[0, 0] = np.nan
    with pytest.raises(InvalidInput, match="input 'x'"):
        check(served(tmp_path, datatype), x)


def test_finite_floats_and_integers_pass(tmp_path: Path) -> None:
    model = served(tmp_path)
    check(model, np.array([[0.0, -1e30, np.finfo(np.float32).max]], dtype=np.float32))
    extreme = np.array([[np.iinfo(np.int64).min, 0, np.iinfo(np.int64).max]], dtype=np.int64)
    validate(
        model,
        {"x": np.zeros((1, 3), dtype=np.float32), "ids": extreme},
        max_rows=64,
        max_text_bytes=1024,
    )


def test_with_the_option_off_non_finite_inputs_pass_unchanged(tmp_path: Path) -> None:
    x = np.array([[np.nan, np.inf, -np.inf]], dtype=np.float32)
    check(served(tmp_path, reject_non_finite=False), x)
