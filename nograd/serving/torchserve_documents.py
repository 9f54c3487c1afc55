"""A served model described as TorchServe's management API answers: the list and describe
bodies, with TorchServe's field names (``modelName``, ``modelVersion``, ``batchSize``...)."""

from __future__ import annotations

from typing import Any

from nograd.runtime.config import TORCHSERVE_FORMAT
from nograd.serving.archives import Archive, describe
from nograd.serving.registry import ServedModel


def archive_of(model: ServedModel) -> Archive | None:
    """The archive a served model was unpacked from; None for a model folder."""
    if model.config.format != TORCHSERVE_FORMAT:
        return None
    return describe(model.directory)


def model_list(models: list[ServedModel]) -> dict[str, Any]:
    """TorchServe's ``GET /models`` body: every model by name with the file it came from."""
    rows = []
    for model in sorted(models, key=lambda m: m.name):
        archive = archive_of(model)
        url = archive.archive_file if archive is not None else model.directory.name
        rows.append({"modelName": model.name, "modelUrl": url})
    return {"models": rows}


def model_description(model: ServedModel, default_delay_ms: float) -> dict[str, Any]:
    """TorchServe's describe body for one model (``GET /models/{m}``, one element of the list)."""
    archive = archive_of(model)
    config = model.config
    batch_limit = model.batcher.limit.current if model.batcher is not None else None
    delay = config.max_queue_delay_ms
    device = str(model.handler.device) if model.handler is not None else config.device
    status = "READY" if model.ready else "UNAVAILABLE" if model.error else "LOADING"
    return {
        "modelName": model.name,
        "modelVersion": archive.version if archive is not None else model.version,
        "modelUrl": archive.archive_file if archive is not None else model.directory.name,
        "runtime": "python",
        "minWorkers": archive.setting("minWorkers", 1) if archive is not None else 1,
        "maxWorkers": archive.setting("maxWorkers", 1) if archive is not None else 1,
        "batchSize": config.max_batch_size or 1,
        "maxBatchDelay": round(default_delay_ms if delay is None else delay),
        "responseTimeout": archive.setting("responseTimeout", 120) if archive is not None else 120,
        "deviceType": "gpu" if device.startswith("cuda") else "cpu",
        "status": status,
        "loadedAtStartup": True,
        "workers": [
            {
                "id": "nograd",
                "status": status,
                "gpu": device.startswith("cuda"),
                "memoryUsage": model.weights_bytes,
            }
        ],
        "nograd": {"version": model.version, "batchLimit": batch_limit, "error": model.error},
    }
