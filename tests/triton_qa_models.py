"""Triton's QA models, as Triton's example clients expect to find them: ``simple``,
``simple_string``, ``simple_identity``, ``simple_int8``, ``simple_sequence`` and
``simple_dyna_sequence`` from Triton's
example repository (tests/fixtures/triton/), and a stand-in for ``densenet_onnx`` (its weights
are a download): Triton's own config and labels over an ONNX graph of the same inputs and
outputs that ranks VULTURE (the image Triton's QA classifies) first."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from tests.triton_models import FIXTURES

QA_MODELS = ("simple", "simple_string", "simple_identity", "simple_int8", "densenet_onnx")
"""The models a server for the example clients loads (``simple_sequence`` and
``simple_dyna_sequence`` are in the repository too: the model-control examples count seven)."""
VULTURE = 23
"""VULTURE's line in ``densenet_labels.txt``, counted from 0."""


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
    for name in (*QA_MODELS[:-1], "simple_sequence", "simple_dyna_sequence"):
        shutil.copytree(FIXTURES / name, repo / name)
    shutil.copytree(FIXTURES / "densenet_onnx", repo / "densenet_onnx")
    densenet_stand_in(repo / "densenet_onnx" / "1" / "model.onnx")
    if with_inception:
        shutil.copytree(FIXTURES / "inception_onnx", repo / "inception_onnx")
    return repo
