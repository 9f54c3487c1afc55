"""A repository of many ONNX models for on-demand residency: each a Triton folder whose weights
are a seeded random matrix of the size asked for, answering ``sum(X @ W) + index`` so a zero input
answers the model's own index (the tests and the ``residency`` phase tell answers apart by it)."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import numpy as np

MIB = 1 << 20
ROWS = 2048
"""Each model's input width: its weights are ``ROWS x columns`` floats."""

CONFIG = """name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 4
dynamic_batching {{ }}
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ {rows} ] }} ]
output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ 1 ] }} ]
"""


def write_onnx_model(folder: Path, index: int, weights_mib: int) -> None:
    """``Y = sum(X @ W) + index`` with ``W`` random (seeded by ``index``) of ``weights_mib``: a
    zero input answers the model's index."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    columns = (weights_mib * MIB) // (4 * ROWS)
    weights = np.random.default_rng(index).standard_normal((ROWS, columns), dtype=np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["H"]),
            helper.make_node("ReduceSum", ["H", "axes"], ["S"], keepdims=1),
            helper.make_node("Add", ["S", "B"], ["Y"]),
        ],
        folder.name,
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", ROWS])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 1])],
        initializer=[
            numpy_helper.from_array(weights * 0.01, "W"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axes"),
            numpy_helper.from_array(np.array([float(index)], dtype=np.float32), "B"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    (folder / "1").mkdir(parents=True)
    onnx.save_model(model, str(folder / "1" / "model.onnx"))
    (folder / "config.pbtxt").write_text(CONFIG.format(name=folder.name, rows=ROWS))


def onnx_repository(root: Path, models: int, weights_mib: int) -> Path:
    repo = root / f"onnx-{models}x{weights_mib}MiB"
    for index in range(models):
        write_onnx_model(repo / f"m{index}", index, weights_mib)
    return repo


def remove_generated(root: Path) -> None:
    """Remove the repositories of generated models under ``root`` and the engine cache beside
    them (their mapped forms): about 1.6 GB a run for 24 models of 32 MiB; ``root`` too when
    nothing else is left in it. The run's record keeps its figures; the next run writes the
    models again, from the same seeds."""
    for path in [*root.glob("onnx-*"), root / "engines"]:
        shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):  # left with what else the run wrote (a fleet's logs)
        root.rmdir()
