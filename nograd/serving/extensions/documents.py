"""A served model described in the Open Inference Protocol's shapes: server and model metadata
and the statistics extension. Both fronts answer from here (HTTP as JSON, gRPC as the messages of
the same fields), so a model is described the same way over every protocol."""

from __future__ import annotations

from typing import Any, Final

from nograd import __version__
from nograd.serving.dataplane import DataPlane
from nograd.serving.registry import ServedModel

EXTENSIONS: Final = (
    "classification",
    "cuda_shared_memory",
    "logging",
    "model_configuration",
    "model_repository",
    "model_repository(unload_dependents)",
    "sequence",
    "statistics",
    "system_shared_memory",
    "trace",
)
"""The extensions every front serves (Triton lists ``cuda_shared_memory`` without a GPU too:
its status and unregister calls answer, registering is refused)."""


SHARED_MEMORY_EXTENSIONS: Final = ("cuda_shared_memory", "system_shared_memory")
"""The extensions ``NOGRAD_SHARED_MEMORY=off`` turns off."""


def server_metadata(
    name: str, extensions: list[str], *, shared_memory: bool = True
) -> dict[str, Any]:
    """The server's metadata; ``name`` is ``NOGRAD_SERVER_NAME``; without ``shared_memory``
    (``NOGRAD_SHARED_MEMORY``) its extensions are not listed."""
    if not shared_memory:
        extensions = [e for e in extensions if e not in SHARED_MEMORY_EXTENSIONS]
    return {"name": name, "version": __version__, "extensions": extensions}


def model_metadata(plane: DataPlane, model: ServedModel) -> dict[str, Any]:
    config = model.config
    if config.batch_dimension is False:
        # No batch dimension (Triton's max_batch_size 0): the shapes requests carry, as listed.
        return {
            "name": config.name,
            "versions": plane.registry.version_names(config.name) or [config.version],
            "platform": config.platform,
            "inputs": [
                {"name": s.name, "datatype": s.datatype, "shape": list(s.shape)}
                for s in config.inputs
            ],
            "outputs": [
                {"name": s.name, "datatype": s.datatype, "shape": list(s.shape)}
                for s in config.outputs
            ],
        }
    return {
        "name": config.name,
        "versions": plane.registry.version_names(config.name) or [config.version],
        "platform": config.platform,
        # A scalar sample is listed as [1], as the model configuration's dims say (Triton's
        # convention); requests may send [n] or [n, 1].
        "inputs": [
            {"name": s.name, "datatype": s.datatype, "shape": [-1, *(s.shape or (1,))]}
            for s in config.inputs
        ],
        "outputs": [
            {"name": s.name, "datatype": s.datatype, "shape": [-1, *s.shape]}
            for s in config.outputs
        ],
    }


def statistics(plane: DataPlane, name: str | None, version: str | None) -> dict[str, Any]:
    """The statistics of one model (version), or of every model when ``name`` is empty."""
    models = [plane.get(name, version)] if name else list(plane.models.values())
    return {
        "model_stats": [plane.statistics.of(m.name).document(m.name, m.version) for m in models]
    }
