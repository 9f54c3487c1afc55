"""Requests checked against the model's declared inputs, and which ones prepare off the loop."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import cast

import numpy as np
import pytest

from nograd.runtime.handler import ModelHandler
from nograd.schema.config import ModelConfig
from nograd.serving.errors import InvalidInput, LimitExceeded
from nograd.serving.registry import ServedModel
from nograd.serving.validation import (
    INLINE_PREPARE_BYTES,
    check_declared,
    prepare_in_thread,
    squeeze_scalar_samples,
    validate,
)
from tests.unit.formats.scaled.format import SCALED


def test_text_longer_than_the_limit_is_refused(tmp_path: Path) -> None:
    config = ModelConfig.model_validate(
        {
            "name": "texts",
            "weights": "",
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": []}],
            "outputs": [{"name": "v", "datatype": "FP32", "shape": [3]}],
        }
    )
    model = ServedModel(config, tmp_path)
    ok = np.array([b"short", b"0123456789"], dtype=object)
    validate(model, {"text": ok}, max_rows=8, max_text_bytes=10)
    with pytest.raises(LimitExceeded, match="11 bytes; the limit is 10 bytes"):
        validate(
            model, {"text": np.array([b"01234567890"], dtype=object)}, max_rows=8, max_text_bytes=10
        )
    with pytest.raises(LimitExceeded, match="has 2 rows, more than the limit of 1"):
        validate(model, {"text": ok}, max_rows=1, max_text_bytes=10)


def test_heavy_prepare_runs_in_a_thread_only_for_large_requests() -> None:
    class Heavy:
        prepare_offload = True

    class Light:
        prepare_offload = False

    def texts(*sizes: int) -> dict[str, np.ndarray]:
        array = np.empty(len(sizes), dtype=np.object_)
        array[:] = [b"x" * size for size in sizes]
        return {"text": array}

    heavy, light = cast(ModelHandler, Heavy()), cast(ModelHandler, Light())
    assert not prepare_in_thread(heavy, texts(200))
    assert not prepare_in_thread(heavy, texts(*[500] * 8))
    assert prepare_in_thread(heavy, texts(INLINE_PREPARE_BYTES + 1))
    assert prepare_in_thread(heavy, texts(*[1000] * 5))
    assert not prepare_in_thread(light, texts(INLINE_PREPARE_BYTES * 10))
    images = {"image": np.zeros((64, 1, 8, 8), dtype=np.float32)}  # 16 KiB of pixels
    assert prepare_in_thread(heavy, images)


def test_a_scalar_sample_sent_with_triton_s_extra_axis_is_squeezed(tmp_path: Path) -> None:
    config = ModelConfig.model_validate(
        {
            "name": "texts",
            "weights": "",
            "inputs": [
                {"name": "text", "datatype": "BYTES", "shape": []},
                {"name": "weight", "datatype": "FP32", "shape": [1]},
            ],
            "outputs": [{"name": "v", "datatype": "FP32", "shape": [3]}],
        }
    )
    model = ServedModel(config, tmp_path)
    texts = np.array([[b"a"], [b"b"]], dtype=object)
    weights = np.ones((2, 1), dtype=np.float32)
    squeezed = squeeze_scalar_samples(model, {"text": texts, "weight": weights})
    assert squeezed["text"].shape == (2,) and list(squeezed["text"]) == [b"a", b"b"]
    assert squeezed["weight"] is weights  # a declared [1] keeps its axis
    validate(model, squeezed, max_rows=8, max_text_bytes=10)
    as_sent = {"text": texts.reshape(-1), "weight": weights}
    assert squeeze_scalar_samples(model, as_sent) is as_sent
    wide = {"text": np.array([[b"a", b"b"]], dtype=object), "weight": weights[:1]}
    with pytest.raises(InvalidInput, match=r"unexpected shape for input 'text'"):
        validate(model, squeeze_scalar_samples(model, wide), max_rows=8, max_text_bytes=10)


def test_declared_inputs_are_checked_without_their_data(tmp_path: Path) -> None:
    """The check a front runs on headers before decoding: the same refusals ``validate`` gives
    on arrays, with the input and the limit named, for shapes no array could be built for."""
    config = ModelConfig.model_validate(
        {
            "name": "pairs",
            "weights": "",
            "inputs": [
                {"name": "text", "datatype": "BYTES", "shape": []},
                {"name": "image", "datatype": "FP32", "shape": [2, -1]},
            ],
            "outputs": [{"name": "v", "datatype": "FP32", "shape": [3]}],
        }
    )
    model = ServedModel(config, tmp_path)
    check_declared(model, {"text": ("BYTES", (3, 1)), "image": ("FP32", (3, 2, 9))}, max_rows=3)
    refusals: list[tuple[dict[str, tuple[str, tuple[int, ...]]], type[Exception], str]] = [
        (
            {"text": ("BYTES", (2**40,)), "image": ("FP32", (2**40, 2, 1))},
            LimitExceeded,
            r"input 'text' has 1099511627776 rows, more than the limit of 3 "
            r"\(NOGRAD_MAX_REQUEST_ROWS\)",
        ),
        (
            {"text": ("BYTES", (1, 2**40)), "image": ("FP32", (1, 2, 1))},
            InvalidInput,
            r"unexpected shape for input 'text' for model 'pairs'\. Expected \[-1\], got "
            r"\[1,1099511627776\]",
        ),
        (
            {"text": ("BYTES", (1,)), "image": ("FP32", (1, 3, 1))},
            InvalidInput,
            r"unexpected shape for input 'image' for model 'pairs'\. Expected \[-1,2,-1\], got "
            r"\[1,3,1\]",
        ),
        (
            {"text": ("FP32", (1,)), "image": ("FP32", (1, 2, 1))},
            InvalidInput,
            "inference input 'text' data-type is 'FP32', but model 'pairs' expects 'BYTES'",
        ),
        (
            {"text": ("BYTES", (1,))},
            InvalidInput,
            r"expected 2 inputs but got 1 inputs for model 'pairs'\. Got input\(s\) \['text'\], "
            r"but missing required input\(s\) \['image'\]\. Please provide all required "
            r"input\(s\)\.",
        ),
        (
            {"text": ("BYTES", (1,)), "image": ("FP32", (2, 2, 1))},
            InvalidInput,
            "disagree on the batch dimension",
        ),
    ]
    for declared, error, message in refusals:
        with pytest.raises(error, match=message):
            check_declared(model, declared, max_rows=3)


def test_an_optional_input_may_be_left_out(tmp_path: Path) -> None:
    config = ModelConfig.model_validate(
        {
            "name": "maybe",
            "format": "python",
            "weights": None,
            "inputs": [
                {"name": "A", "datatype": "FP32", "shape": [2]},
                {"name": "B", "datatype": "FP32", "shape": [2], "optional": True},
            ],
            "outputs": [{"name": "Y", "datatype": "FP32", "shape": [2]}],
        }
    )
    model = ServedModel(config, tmp_path)
    check_declared(model, {"A": ("FP32", (1, 2))}, max_rows=4)
    check_declared(model, {"A": ("FP32", (1, 2)), "B": ("FP32", (1, 2))}, max_rows=4)
    with pytest.raises(
        InvalidInput,
        match=r"expected number of inputs between 1 and 2 but got 1 inputs for model 'maybe'\. "
        r"Got input\(s\) \['B'\], but missing required input\(s\) \['A'\]",
    ):
        check_declared(model, {"B": ("FP32", (1, 2))}, max_rows=4)
    only_optional = config.model_copy(update={"inputs": (config.inputs[1],)})
    with pytest.raises(InvalidInput, match="the request carries no input for model 'maybe'"):
        check_declared(ServedModel(only_optional, tmp_path), {}, max_rows=4)


def test_optional_inputs_are_refused_outside_the_python_backend() -> None:
    with pytest.raises(ValueError, match="'optional' inputs are served for Python-backend models"):
        ModelConfig.model_validate(
            {
                "name": "onnx_maybe",
                "format": "onnx",
                "artifact": "model.onnx",
                "weights": None,
                "inputs": [{"name": "B", "datatype": "FP32", "shape": [2], "optional": True}],
                "outputs": [{"name": "Y", "datatype": "FP32", "shape": [2]}],
            }
        )


def test_a_format_that_refuses_rows_over_the_limit_is_answered_in_its_words(
    tmp_path: Path,
) -> None:
    """The refusal of rows above ``max_batch_size`` and the shape refusal's note are the format's
    answers, not a test of which format read the model: a new format sets them in its row."""
    config = ModelConfig.model_validate(
        {
            "name": "scaled",
            "backend": SCALED.name,
            "weights": None,
            "max_batch_size": 2,
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}],
        }
    )
    model = ServedModel(config, tmp_path)
    check_declared(model, {"x": ("FP32", (3, 2))}, max_rows=8)  # split, as nograd's are
    model.format = dataclasses.replace(
        SCALED, refuses_rows_over_batch_limit=True, shape_refusal_note="NOTE: batched."
    )
    with pytest.raises(InvalidInput, match="batch-size must be <= 2 for 'scaled'"):
        check_declared(model, {"x": ("FP32", (3, 2))}, max_rows=8)
    with pytest.raises(InvalidInput, match=r"Expected \[-1,2\], got \[1,3\]\. NOTE: batched\.$"):
        check_declared(model, {"x": ("FP32", (1, 3))}, max_rows=8)
