"""An artifact's inputs and outputs, read from the artifact, for a config that leaves them out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nograd.core.engines import engine_row
from nograd.runtime.engines.errors import ArtifactError
from nograd.runtime.engines.registry import engine
from nograd.schema.config import ModelConfig, TensorSpec


def with_signature(config: ModelConfig, path: Path) -> ModelConfig:
    """``config`` with the inputs and outputs it omits read from the artifact at ``path``."""
    if config.inputs and config.outputs:
        return config
    if not engine_row(config.format).reads_signature:
        raise ArtifactError(f"{path}: a {config.format} artifact needs inputs and outputs listed")
    inputs, outputs = engine(config.format).signature(path)
    return config.model_copy(
        update={"inputs": config.inputs or inputs, "outputs": config.outputs or outputs}
    )


def tensor_spec(path: Path, name: str, datatype: str | None, shape: list[Any]) -> TensorSpec:
    """One input or output as the artifact at ``path`` declares it (batch dimension first)."""
    if datatype is None:
        raise ArtifactError(f"{path}: {name!r} has a datatype nograd does not serve")
    if not shape:
        raise ArtifactError(f"{path}: {name!r} has no batch dimension")
    dims = tuple(dim if isinstance(dim, int) and dim > 0 else -1 for dim in shape[1:])
    return TensorSpec.model_validate({"name": name, "datatype": datatype, "shape": dims})
