"""Triton model repositories for the tests: Triton's own folders (tests/fixtures/triton) with the
models Triton's QA generates rather than ships built here, seeded, beside a nograd folder."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "triton"


class SumDifference(torch.nn.Module):
    """Triton's ``simple`` model as TorchScript: the sum and the difference of two tensors."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a - b


class ScaleShift(torch.nn.Module):
    """A model without a batch dimension, taking its input by name: ``2 * x + 1``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x + 1


NO_BATCH_CONFIG = """
name: "scale_shift"
platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "x", data_type: TYPE_FP32, dims: [ 2, 3 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 2, 3 ] } ]
"""


def save_torchscript(module: torch.nn.Module, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # torch deprecates TorchScript; Triton's PyTorch backend serves nothing else.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(module), str(path))


def fixed_shape_onnx(path: Path) -> None:
    """An ONNX model whose input has no variable first dimension (``Y = X + 1`` on [2, 3]):
    Triton's auto-complete gives it no batch dimension."""
    import onnx
    from onnx import TensorProto, helper

    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "one"], ["Y"])],
        "fixed",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])],
        initializer=[one],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))


GUARDED_CONFIG = """
name: "guarded"
backend: "python"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 20000 }
version_policy: { all { } }
input [ { name: "X", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 2 ] } ]
"""
GUARDED_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

SCALE = {scale}


class TritonPythonModel:
    def initialize(self, args):
        self.version = args["model_version"]
        self.batches = 0

    def execute(self, requests):
        self.batches += 1
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x < 0).any():
                code = pb_utils.TritonError.INVALID_ARG
                error = pb_utils.TritonError("X must not be negative", code)
                responses.append(pb_utils.InferenceResponse(error=error))
            elif (x > 1000).any():
                error = pb_utils.TritonError("too large")
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                # How many requests this execute call took, in every row's second column.
                y = np.stack([x[:, 0] * SCALE, np.full(len(x), len(requests), np.float32)], 1)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
"""
"""A Python-backend model written for these tests: an error response per bad request (400 for
INVALID_ARG, 500 for the default INTERNAL), and two versions whose ``model.py`` differ."""


def triton_repository(root: Path) -> Path:
    """Triton folders and a nograd one side by side:

    - ``simple`` (Triton's, ONNX) with versions 1 and 2: the default policy serves 2 alone;
    - ``simple_int8`` (Triton's, ONNX);
    - ``simple_specific``: ``simple`` with versions 1 to 3 and a policy serving 1 and 3;
    - ``cpu_instance`` (Triton's QA config) with a generated TorchScript ``model.pt``;
    - ``scale_shift``: TorchScript without a batch dimension;
    - ``auto``: ``simple``'s model.onnx with no config (auto-complete: batched, 4 rows);
    - ``fixed``: a fixed-shape ONNX model with no config (auto-complete: no batch dimension);
    - ``unsupported``: ``simple`` with ``sequence_batching``: refused, naming the field;
    - ``simple_identity`` (Triton's, the Python backend, TYPE_STRING), python_backend's
      ``add_sub`` and ``pytorch`` examples, and ``guarded`` (a Python model with error
      responses and two versions);
    - ``digits``: nograd's own folder.
    """
    torch.manual_seed(0)
    repo = root / "repo"
    repo.mkdir(parents=True)
    simple = FIXTURES / "simple"
    for name in ("simple", "simple_int8", "simple_identity"):
        shutil.copytree(FIXTURES / name, repo / name)
    shutil.copytree(simple / "1", repo / "simple" / "2")
    specific = repo / "simple_specific"
    for version in ("1", "2", "3"):
        shutil.copytree(simple / "1", specific / version)
    text = (simple / "config.pbtxt").read_text().replace('"simple"', '"simple_specific"')
    (specific / "config.pbtxt").write_text(
        text + "\nversion_policy: { specific: { versions: [ 1, 3 ] } }\n"
    )
    unsupported = repo / "unsupported"
    shutil.copytree(simple / "1", unsupported / "1")
    (unsupported / "config.pbtxt").write_text(
        text.replace('"simple_specific"', '"unsupported"') + "\nsequence_batching { }\n"
    )
    shutil.copytree(FIXTURES / "cpu_instance", repo / "cpu_instance")
    save_torchscript(SumDifference(), repo / "cpu_instance" / "1" / "model.pt")
    save_torchscript(ScaleShift(), repo / "scale_shift" / "1" / "model.pt")
    (repo / "scale_shift" / "config.pbtxt").write_text(NO_BATCH_CONFIG)
    shutil.copytree(simple / "1", repo / "auto" / "1")
    fixed_shape_onnx(repo / "fixed" / "1" / "model.onnx")
    for name in ("add_sub", "pytorch"):
        shutil.copytree(FIXTURES / name, repo / name)
    (repo / "guarded").mkdir()
    (repo / "guarded" / "config.pbtxt").write_text(GUARDED_CONFIG)
    for version, scale in (("1", 1), ("2", 10)):
        (repo / "guarded" / version).mkdir()
        (repo / "guarded" / version / "model.py").write_text(GUARDED_MODEL.format(scale=scale))
    shutil.copytree(ROOT / "models" / "digits", repo / "digits")
    return repo


SERVED = (
    "simple",
    "simple_int8",
    "simple_specific",
    "cpu_instance",
    "scale_shift",
    "auto",
    "simple_identity",
    "add_sub",
    "pytorch",
    "guarded",
)
"""The Triton models the e2e server loads at start-up (with ``fixed`` and ``digits``)."""
