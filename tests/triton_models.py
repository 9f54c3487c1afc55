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


def triton_repository(root: Path) -> Path:
    """Triton folders and a nograd one side by side:

    - ``simple`` (Triton's, ONNX) with versions 1 and 2: the default policy serves 2 alone;
    - ``simple_int8`` (Triton's, ONNX);
    - ``simple_specific``: ``simple`` with versions 1 to 3 and a policy serving 1 and 3;
    - ``cpu_instance`` (Triton's QA config) with a generated TorchScript ``model.pt``;
    - ``scale_shift``: TorchScript without a batch dimension;
    - ``auto``: ``simple``'s model.onnx with no config (auto-complete: batched, 4 rows);
    - ``fixed``: a fixed-shape ONNX model with no config (auto-complete: no batch dimension);
    - ``unsupported``: ``simple`` with ``sequence_batching``, and ``simple_identity`` (the
      Python backend): both refused, naming the field;
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
    shutil.copytree(ROOT / "models" / "digits", repo / "digits")
    return repo


SERVED = ("simple", "simple_int8", "simple_specific", "cpu_instance", "scale_shift", "auto")
"""The Triton models the e2e server loads at start-up (with ``fixed`` and ``digits``)."""
