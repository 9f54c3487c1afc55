"""Triton's auto-complete of an ONNX model whose config gives no inputs, outputs or batch size."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from nograd.runtime.engines.errors import ArtifactError
from nograd.runtime.engines.onnx import OnnxTensor, onnx_tensors
from nograd.runtime.engines.signature import tensor_spec
from nograd.schema.config import ModelConfig, TensorSpec

AUTO_MAX_BATCH_SIZE: Final = 4
"""The batch limit Triton's auto-complete gives a model that can batch (its default)."""


def auto_complete(config: ModelConfig, path: Path) -> ModelConfig:
    """The graph's tensors where the config lists none; batched (``AUTO_MAX_BATCH_SIZE`` rows
    unless the config sets a limit) only when every tensor's first dimension is variable,
    otherwise no batch dimension, requests carrying the full shapes."""
    if config.format != "onnx":
        raise ArtifactError(f"{path}: only an ONNX model's batch dimension is read from it")
    inputs, outputs = onnx_tensors(path)
    batched = all(shape and shape[0] is None for _, _, shape in [*inputs, *outputs])

    def specs(tensors: list[OnnxTensor]) -> tuple[TensorSpec, ...]:
        # tensor_spec cuts the first dimension: without a batch one, a placeholder goes first.
        return tuple(
            tensor_spec(path, name, kind, shape if batched else [1, *shape])
            for name, kind, shape in tensors
        )

    return config.model_copy(
        update={
            "inputs": config.inputs or specs(inputs),
            "outputs": config.outputs or specs(outputs),
            "batch_dimension": batched,
            "max_batch_size": (config.max_batch_size or AUTO_MAX_BATCH_SIZE) if batched else 1,
        }
    )
