"""Triton's Python backend in nograd: the ``triton_python_backend_utils`` a model imports, the
handler's requests and responses (one execute per batch, errors per request), auto-complete,
and ``finalize``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nograd.core.errors import ModelAnswered
from nograd.formats.triton.reading.config import read_triton
from nograd.formats.triton.running.python_backend import utils
from nograd.formats.triton.running.python_backend.handler import PythonBackendHandler
from nograd.runtime.handler import ModelHandler, TensorPart
from nograd.runtime.loader import build_handler
from nograd.runtime.runners import batch_runner
from tests.triton_models import FIXTURES, TALLY_CONFIG, TALLY_MODEL


def test_bytes_round_trip_and_type_tables() -> None:
    text = np.array([b"a", b"", "\u00e9".encode()], dtype=np.object_)
    encoded = utils.serialize_byte_tensor(text)
    assert encoded[:5] == b"\x01\x00\x00\x00a"
    np.testing.assert_array_equal(utils.deserialize_bytes_tensor(encoded), text)
    assert utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert utils.numpy_to_triton_type(np.float32) == 11
    assert utils.triton_to_numpy_type(13) is np.object_
    assert utils.numpy_to_triton_type(np.bytes_) == 13


def test_config_look_ups_and_auto_complete_checks() -> None:
    document = {"name": "m", "max_batch_size": 0, "input": [{"name": "A", "dims": [2]}]}
    assert utils.get_input_config_by_name(document, "A") == {"name": "A", "dims": [2]}
    assert utils.get_output_config_by_name(document, "B") is None
    config = utils.ModelConfig(json.dumps(document))
    config.set_max_batch_size(4)
    config.set_dynamic_batching()
    config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [2]})
    config.add_output({"name": "B", "data_type": "TYPE_FP32", "dims": [2]})
    completed = config.as_dict()
    assert completed["max_batch_size"] == 4 and completed["dynamic_batching"] == {}
    assert completed["input"] == [{"name": "A", "data_type": "TYPE_FP32", "dims": [2]}]
    with pytest.raises(ValueError, match="expects dims"):
        config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [3]})
    with pytest.raises(ValueError, match="property other than"):
        config.add_output({"name": "C", "data_type": "TYPE_FP32", "dims": [1], "x": 1})


def _parts(*rows: list[float]) -> list[TensorPart]:
    return [TensorPart({"X": np.array([row], dtype=np.float32)}, 1) for row in rows]


MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

CALLS = []


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.set_max_batch_size(4)
        config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [2]})
        config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [2]})
        return config

    def initialize(self, args):
        self.args = args
        self.config = json.loads(args["model_config"])

    def execute(self, requests):
        CALLS.append(len(requests))
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x.sum() < 0:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("neg")))
            elif x.sum() > 100:
                raise pb_utils.TritonModelException("far too large")
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
        return responses

    def finalize(self):
        CALLS.append("finalized")
"""


@pytest.fixture
def python_model(tmp_path: Path) -> PythonBackendHandler:
    folder = tmp_path / "repo" / "doubled"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('backend: "python"\n')
    (folder / "1" / "model.py").write_text(MODEL)
    config = read_triton(folder).model_copy(update={"version": "1"})
    handler = build_handler(tmp_path / "repo", folder / "1", config, torch.device("cpu"))
    assert isinstance(handler, PythonBackendHandler)
    return handler


def test_a_python_model_is_the_batchers_runner_itself(python_model: PythonBackendHandler) -> None:
    """No torch module stands behind it and no torch runner asks it whether to run a batch."""
    assert not isinstance(python_model, ModelHandler)
    assert batch_runner(python_model) is python_model
    assert python_model.weights_bytes == 0


def test_auto_complete_initialize_and_one_execute_per_batch(
    python_model: PythonBackendHandler,
) -> None:
    handler = python_model
    config = handler.config
    assert (config.max_batch_size, config.batch_dimension) == (4, True)
    assert [spec.name for spec in config.inputs] == ["X"]
    assert json.loads(config.triton_config or "")["max_batch_size"] == 4
    args = handler.model.args  # type: ignore[attr-defined]
    assert (args["model_name"], args["model_version"], args["model_instance_kind"]) == (
        "doubled",
        "1",
        "CPU",
    )
    outcomes = python_model.run_batch(_parts([1, 2], [-5, 0], [3, 4]))
    np.testing.assert_array_equal(outcomes[0]["Y"], [[2, 4]])
    assert isinstance(outcomes[1], ModelAnswered) and str(outcomes[1]) == "neg"
    assert outcomes[1].status == 500
    np.testing.assert_array_equal(outcomes[2]["Y"], [[6, 8]])
    module = __import__("sys").modules["nograd_models.doubled.v1"]
    assert module.CALLS == [3]
    handler.close()
    assert module.CALLS[-1] == "finalized"


def test_execute_raising_fails_its_whole_batch(python_model: PythonBackendHandler) -> None:
    outcomes = python_model.run_batch(_parts([1, 2], [500, 0]))
    assert all(isinstance(outcome, ModelAnswered) for outcome in outcomes)
    assert "Failed to process the request(s) for model 'doubled', message: " in str(outcomes[0])
    assert "far too large" in str(outcomes[0])


def test_examples_load_as_separate_modules(tmp_path: Path) -> None:
    handlers = []
    for name in ("add_sub", "pytorch"):
        config = read_triton(FIXTURES / name).model_copy(update={"version": "1"})
        handlers.append(build_handler(FIXTURES, FIXTURES / name / "1", config, torch.device("cpu")))
    a = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)  # one request, its batch axis added
    for handler in handlers:
        (answer,) = batch_runner(handler).run_batch([TensorPart({"INPUT0": a, "INPUT1": a}, 1)])
        np.testing.assert_array_equal(answer["OUTPUT0"], 2 * a)
        np.testing.assert_array_equal(answer["OUTPUT1"], 0 * a)
    assert type(handlers[0].model).__module__ != type(handlers[1].model).__module__  # type: ignore[attr-defined]


def test_a_python_model_keys_its_state_by_the_sequence_s_correlation_id(tmp_path: Path) -> None:
    """``tally_named`` (no CORRID control) keys its sums by ``request.correlation_id()``, a
    number or a string, and reads the sequence's flags from ``request.flags()``."""
    from nograd.schema.sequence_step import FLAG_END, FLAG_START, SequenceStep

    folder = tmp_path / "repo" / "keyed"
    (folder / "1").mkdir(parents=True)
    config_text = TALLY_CONFIG.format(name="keyed", strategy="", corrid="")
    (folder / "config.pbtxt").write_text(config_text)
    (folder / "1" / "model.py").write_text(TALLY_MODEL)
    config = read_triton(folder).model_copy(update={"version": "1"})
    runner = build_handler(tmp_path / "repo", folder / "1", config, torch.device("cpu"))

    def part(value: int, sequence_id: int | str, flags: int = 0) -> TensorPart:
        controls = {"START": flags & FLAG_START, "END": flags & FLAG_END, "READY": 1}
        tensors = {name: np.array([[int(bool(on))]], np.int32) for name, on in controls.items()}
        tensors["INPUT"] = np.array([[value]], np.int32)
        return TensorPart(tensors, 1, sequence=SequenceStep(sequence_id, flags, {}))

    runner.run_batch([part(5, 7, FLAG_START), part(1, "u", FLAG_START)])
    answers = runner.run_batch([part(3, 7), part(2, "u", FLAG_END)])
    assert [int(answer["OUTPUT"][0, 0]) for answer in answers] == [8, 3]  # type: ignore[index]
    # START, END, READY, flags(), and the key being the correlation id.
    assert answers[1]["CONTROLS"].tolist() == [[0, 1, 1, FLAG_END, 1]]  # type: ignore[index]
    assert set(runner.model.sums) == {7}  # type: ignore[attr-defined]
