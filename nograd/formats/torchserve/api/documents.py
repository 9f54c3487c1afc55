"""A served model described as TorchServe's management API answers: the list and describe
bodies, with TorchServe's field names (``modelName``, ``modelVersion``, ``batchSize``...)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from nograd.formats.torchserve.reading.archives import Archive, describe
from nograd.schema.config import TORCHSERVE_FORMAT
from nograd.serving.registry import ServedModel


@dataclass(frozen=True)
class DescribeDefaults:
    """The server-wide values a description falls back on, and when this process started."""

    max_queue_delay_ms: float
    max_queue_size: int
    start_time: str


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


def model_description(
    model: ServedModel, defaults: DescribeDefaults, workers: tuple[int, int] | None = None
) -> dict[str, Any]:
    """TorchServe's describe body for one model (``GET /models/{m}``, one element of the list),
    its fields in TorchServe's order; settings nograd has no use for (sequences, parallelism)
    keep TorchServe's defaults, and nograd's own state follows under ``nograd``. ``workers``:
    the minWorkers and maxWorkers a register or scale call set, else the archive's; the
    ``workers`` list is what serves, nograd's one instance of the model in this process."""
    archive = archive_of(model)
    config = model.config
    batch_limit = model.batcher.limit.current if model.batcher is not None else None
    delay = config.max_queue_delay_ms
    device = str(model.handler.device) if model.handler is not None else config.device
    status = "READY" if model.ready else "UNAVAILABLE" if model.error else "LOADING"

    def setting(key: str, default: int) -> int:
        return archive.setting(key, default) if archive is not None else default

    pending = model.batcher.queue_depth if model.batcher is not None else 0
    capacity = config.max_queue_size or defaults.max_queue_size
    return {
        "modelName": model.name,
        "modelVersion": archive.version if archive is not None else model.version,
        "modelUrl": archive.archive_file if archive is not None else model.directory.name,
        "runtime": "python",
        "minWorkers": setting("minWorkers", 1) if workers is None else workers[0],
        "maxWorkers": setting("maxWorkers", 1) if workers is None else workers[1],
        "batchSize": config.max_batch_size or 1,
        "maxBatchDelay": round(defaults.max_queue_delay_ms if delay is None else delay),
        "responseTimeout": setting("responseTimeout", 120),
        "startupTimeout": setting("startupTimeout", 120),
        "maxRetryTimeoutInSec": setting("maxRetryTimeoutInSec", 300),
        "clientTimeoutInMills": setting("clientTimeoutInMills", 0),
        "parallelType": "",
        "parallelLevel": 0,
        "deviceType": "gpu" if device.startswith("cuda") else "cpu",
        "continuousBatching": False,
        "useJobTicket": False,
        "useVenv": False,
        "stateful": False,
        "sequenceMaxIdleMSec": 0,
        "sequenceTimeoutMSec": 0,
        "maxNumSequence": 0,
        "maxSequenceJobQueueSize": 0,
        "loadedAtStartup": True,
        "workers": [
            {
                "id": "nograd",
                "startTime": defaults.start_time,
                "status": status,
                "memoryUsage": model.weights_bytes,
                "pid": os.getpid(),
                "gpu": device.startswith("cuda"),
                "gpuUsage": "N/A",
            }
        ],
        "jobQueueStatus": {
            "remainingCapacity": max(0, capacity - pending),
            "pendingRequests": pending,
        },
        "nograd": {
            "version": model.version,
            "status": status,
            "batchLimit": batch_limit,
            "error": model.error,
        },
    }
