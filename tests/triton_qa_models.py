"""Triton's QA models, as Triton's example clients expect to find them: ``simple``,
``simple_string``, ``simple_identity``, ``simple_int8`` and ``simple_sequence`` from Triton's
example repository (tests/fixtures/triton/), and a stand-in for ``densenet_onnx`` (its weights
are a download): Triton's own config and labels over an ONNX graph of the same inputs and
outputs that ranks VULTURE (the image Triton's QA classifies) first; and ``repeat_int32``, Triton's
decoupled example, as a Python model."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from tests.triton_models import FIXTURES

QA_MODELS = (
    "simple",
    "simple_string",
    "simple_identity",
    "simple_int8",
    "densenet_onnx",
    "repeat_int32",
    "simple_sequence",
)
"""The models a server for the example clients loads (the HTTP model-control example counts
seven in the repository)."""
VULTURE = 23
"""VULTURE's line in ``densenet_labels.txt``, counted from 0."""


REPEAT_CONFIG = """
name: "repeat_int32"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "IN", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "DELAY", data_type: TYPE_UINT32, dims: [ -1 ] },
  { name: "WAIT", data_type: TYPE_UINT32, dims: [ 1 ] }
]
output [
  { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "IDX", data_type: TYPE_UINT32, dims: [ 1 ] }
]
"""
REPEAT_MODEL = """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()
            wait = pb_utils.get_input_tensor_by_name(request, "WAIT").as_numpy()
            sender = request.get_response_sender()
            threading.Thread(target=self.repeat, args=(sender, values, delays, wait)).start()
        return None

    def repeat(self, sender, values, delays, wait):
        for index, (value, delay) in enumerate(zip(values, delays)):
            time.sleep(int(delay) / 1000)
            out = pb_utils.Tensor("OUT", np.array([value], np.int32))
            idx = pb_utils.Tensor("IDX", np.array([index], np.uint32))
            sender.send(pb_utils.InferenceResponse([out, idx]))
        time.sleep(int(wait[0]) / 1000)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""
"""Triton's ``repeat`` example backend (C++, src/backends/backend/examples/repeat.cc in Triton's
tree) as a decoupled Python model of the same tensors: one response per ``IN`` value, each after
its ``DELAY`` (ms), then the final flag after ``WAIT`` (ms)."""


def densenet_stand_in(path: Path) -> None:
    """``data_0`` [1, 3, 224, 224] -> ``fc6_1`` [1, 1000, 1, 1]: the image's mean colour through a
    seeded 1x1 convolution, VULTURE's bias above every other class's reach."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = rng.normal(0.0, 0.1, (1000, 3, 1, 1)).astype(np.float32)
    bias = rng.normal(0.0, 0.1, 1000).astype(np.float32)
    bias[VULTURE] += 10.0
    graph = helper.make_graph(
        [
            helper.make_node("GlobalAveragePool", ["data_0"], ["pooled"]),
            helper.make_node("Conv", ["pooled", "weight", "bias"], ["fc6_1"]),
        ],
        "densenet_stand_in",
        [helper.make_tensor_value_info("data_0", TensorProto.FLOAT, [1, 3, 224, 224])],
        [helper.make_tensor_value_info("fc6_1", TensorProto.FLOAT, [1, 1000, 1, 1])],
        initializer=[
            numpy_helper.from_array(weight, "weight"),
            numpy_helper.from_array(bias, "bias"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))


def qa_repository(root: Path, *, with_inception: bool = False) -> Path:
    """The QA models; ``with_inception`` adds Triton's ``inception_onnx`` config (its model is a
    download: listed by the index, never loaded), the eighth model Triton's gRPC model-control
    example counts."""
    repo = root / ("qa_repo_8" if with_inception else "qa_repo")
    repo.mkdir(parents=True)
    for name in (*QA_MODELS[:4], "simple_sequence"):  # Triton's own model.onnx for the last
        shutil.copytree(FIXTURES / name, repo / name)
    shutil.copytree(FIXTURES / "densenet_onnx", repo / "densenet_onnx")
    densenet_stand_in(repo / "densenet_onnx" / "1" / "model.onnx")
    (repo / "repeat_int32" / "1").mkdir(parents=True)
    (repo / "repeat_int32" / "config.pbtxt").write_text(REPEAT_CONFIG)
    (repo / "repeat_int32" / "1" / "model.py").write_text(REPEAT_MODEL)
    if with_inception:
        shutil.copytree(FIXTURES / "inception_onnx", repo / "inception_onnx")
    return repo
