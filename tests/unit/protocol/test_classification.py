"""Triton's classification extension: the top classes of each row, formatted as Triton's server
formats them (``std::to_string``), with labels where the output has them."""

from __future__ import annotations

import numpy as np
import pytest

from nograd.core.errors import DecodeError
from nograd.protocol.classification import class_count, classified, top_classes


def _texts(array: np.ndarray) -> list[object]:
    return np.vectorize(lambda value: value.decode())(array).tolist()


def test_each_row_answers_its_best_classes_with_six_decimals_and_labels() -> None:
    scores = np.array([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25]], dtype=np.float32)
    answer = top_classes(scores, 2, ["cat", "dog"], batched=True)
    assert answer.shape == (2, 2)
    assert _texts(answer) == [
        ["0.700000:1:dog", "0.200000:2"],
        ["0.500000:0:cat", "0.250000:1:dog"],  # a tie keeps index order
    ]


def test_integers_are_written_as_digits_and_the_count_is_capped_by_the_row() -> None:
    values = np.array([3, -7, 12], dtype=np.int32)
    assert _texts(top_classes(values, 10, [], batched=False)) == ["12:2", "3:0", "-7:1"]
    unsigned = np.array([[250, 1]], dtype=np.uint8)
    assert _texts(top_classes(unsigned, 1, [], batched=True)) == [["250:0"]]


def test_a_row_of_several_dimensions_is_classified_whole() -> None:
    values = np.arange(8, dtype=np.float64).reshape(2, 2, 2)
    assert _texts(top_classes(values, 1, [], batched=True)) == [["3.000000:3"], ["7.000000:3"]]


def test_only_the_outputs_asked_for_are_replaced() -> None:
    outputs = {"a": np.array([[1.0, 2.0]], dtype=np.float32), "b": np.array([[5]])}
    answered = classified(outputs, {"a": 1}, {"a": ("x", "y")}, batched=True)
    assert _texts(answered["a"]) == [["2.000000:1:y"]]
    assert answered["b"] is outputs["b"]
    with pytest.raises(DecodeError, match="unsupported type 'FP16'"):
        classified({"h": np.zeros((1, 2), np.float16)}, {"h": 1}, {}, batched=True)


@pytest.mark.parametrize("value", [0, -1, True, "3", 2.5, None])
def test_the_parameter_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(DecodeError, match="'classification' must be a positive integer"):
        class_count(value, "out")
    assert class_count(3, "out") == 3
