"""Triton's ``model_warmup`` built and run as Triton runs it: zero, random and file data,
``batch_size`` requests in one batch, ``count`` runs, and the load failing with Triton's message
when a sample cannot be built or fails."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from nograd.formats.triton.reading.config import read_triton
from nograd.formats.triton.running.warmup import (
    WarmupFailed,
    WarmupSample,
    run_warmup,
    warmup_samples,
)
from nograd.runtime.loader import build_handler
from tests.triton_models import FIXTURES

SIMPLE = (FIXTURES / "simple" / "config.pbtxt").read_text()


def _samples(
    tmp_path: Path, warmup: str, files: dict[str, bytes] | None = None
) -> list[WarmupSample]:
    folder = tmp_path / "simple"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(SIMPLE + warmup)
    for name, data in (files or {}).items():
        (folder / "warmup").mkdir(exist_ok=True)
        (folder / "warmup" / name).write_bytes(data)
    config = read_triton(folder).model_copy(update={"version": "1"})
    return warmup_samples(config, folder)


def _sample(name: str, input0: str, input1: str = "zero_data: true", extra: str = "") -> str:
    return f"""
model_warmup [{{
  name: "{name}" batch_size: 2 {extra}
  inputs {{ key: "INPUT0" value: {{ data_type: TYPE_INT32 dims: [ 16 ] {input0} }} }}
  inputs {{ key: "INPUT1" value: {{ data_type: TYPE_INT32 dims: [ 16 ] {input1} }} }}
}}]
"""


def test_zero_random_and_file_data(tmp_path: Path) -> None:
    values = np.arange(16, dtype="<i4")
    warmup = _sample("s", 'input_data_file: "raw"', "random_data: true", "count: 3")
    (sample,) = _samples(tmp_path, warmup, {"raw": values.tobytes() + b"extra"})
    assert (sample.name, len(sample.parts), sample.count) == ("s", 2, 3)
    tensors = sample.parts[0].tensors
    np.testing.assert_array_equal(tensors["INPUT0"], values[np.newaxis])
    assert tensors["INPUT1"].shape == (1, 16) and tensors["INPUT1"].dtype == np.int32
    (zero,) = _samples(tmp_path, _sample("z", "zero_data: true"))
    assert not zero.parts[0].tensors["INPUT0"].any() and zero.count == 1


def test_batch_size_zero_is_skipped(tmp_path: Path) -> None:
    assert _samples(tmp_path, _sample("s", "zero_data: true").replace("batch_size: 2", "")) == []


@pytest.mark.parametrize(
    ("warmup", "files", "message"),
    [
        (
            _sample("s", 'input_data_file: "raw"'),
            {"raw": b"\0" * 10},
            "warmup setting expects 64 bytes, but the data provided from raw only has 10 bytes",
        ),
        (
            _sample("s", "").replace("dims: [ 16 ]  }", "dims: [ 16 ] }"),
            None,
            "warmup setting expects input 'INPUT0' to have input_data_type set",
        ),
        (
            _sample("s", "zero_data: true").replace("dims: [ 16 ] zero", "dims: [ -1 ] zero", 1),
            None,
            "warmup setting expects all variable-size dimensions are specified for input 'INPUT0'",
        ),
        (
            _sample("s", "zero_data: true").replace("TYPE_INT32", "TYPE_FP32", 1),
            None,
            "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'",
        ),
        (
            _sample("s", "zero_data: true").replace("batch_size: 2", "batch_size: 9"),
            None,
            "batch_size 9 is more than model 'simple' takes in one batch (8, its max_batch_size)",
        ),
        (
            _sample("s", "zero_data: true").replace('key: "INPUT1"', 'key: "OTHER"'),
            None,
            "input 'OTHER' is not an input of model 'simple'",
        ),
    ],
)
def test_samples_that_cannot_be_built_fail_the_load(
    tmp_path: Path, warmup: str, files: dict[str, bytes] | None, message: str
) -> None:
    with pytest.raises(WarmupFailed, match=re.escape(message)):
        _samples(tmp_path, warmup, files)


MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

CALLS = []


class TritonPythonModel:
    def execute(self, requests):
        CALLS.append(len(requests))
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x.sum() == 0:
                error = pb_utils.TritonError("An Error Occurred")
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
"""

PYTHON_CONFIG = """
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
model_warmup [{
  name: "%s" batch_size: 3 count: 2
  inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 2 ] %s } }
}]
"""


@pytest.mark.parametrize("data", ["random_data: true", "zero_data: true"])
def test_python_models_warm_up_through_execute(tmp_path: Path, data: str) -> None:
    folder = tmp_path / "repo" / f"warmed_{data[0]}"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(PYTHON_CONFIG % ("zero sample", data))
    (folder / "1" / "model.py").write_text(MODEL)
    config = read_triton(folder).model_copy(update={"version": "1"})
    handler = build_handler(tmp_path / "repo", folder / "1", config, torch.device("cpu"))
    samples = warmup_samples(handler.config, folder)
    module = __import__("sys").modules[f"nograd_models.{folder.name}.v1"]
    if data.startswith("zero"):
        with pytest.raises(
            WarmupFailed,
            match=re.escape("failed to run warmup sample 'zero sample': An Error Occurred"),
        ):
            run_warmup(handler, samples)
        assert module.CALLS == [3]
    else:
        run_warmup(handler, samples)
        assert module.CALLS == [3, 3]  # batch_size requests in one execute, count times


def test_onnx_model_runs_its_samples(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "repo" / "simple"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(
        (FIXTURES / "simple" / "1" / "model.onnx").read_bytes()
    )
    (folder / "config.pbtxt").write_text(
        SIMPLE + _sample("s", "random_data: true", extra="count: 2")
    )
    config = read_triton(folder).model_copy(update={"version": "1"})
    handler = build_handler(tmp_path / "repo", folder / "1", config, torch.device("cpu"))
    with caplog.at_level("INFO"):
        run_warmup(handler, warmup_samples(handler.config, folder))
    assert "model 'simple' is running warmup sample 's' for iteration 2" in caplog.text
