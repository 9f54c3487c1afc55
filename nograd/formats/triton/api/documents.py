"""A served model described in Triton's model configuration and repository index shapes.

Triton's clients and tools read these before anything else: ``perf_analyzer`` will not start
without a model's configuration, and ``tritonclient`` exposes both. Both transports answer from
here, so HTTP and gRPC describe a model the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

from nograd.core.datatypes import TABLE
from nograd.formats.triton.reading.config import ONNX, PYTHON, completed_document
from nograd.schema.config import TensorSpec, version_order
from nograd.serving.registry import LOADING_ON_DEMAND, ServedModel, State
from nograd.settings import Settings

TRITON_TYPES: Final[dict[str, str]] = {row.name: row.triton for row in TABLE}
"""Open Inference Protocol datatypes to Triton's ``DataType`` names (BYTES is TYPE_STRING)."""

INDEX_STATES: Final[dict[State, str]] = {
    State.LOADING: "LOADING",
    State.READY: "READY",
    State.FAILED: "UNAVAILABLE",
    State.UNLOADED: "UNAVAILABLE",
}


def _tensor(spec: TensorSpec, *, is_input: bool) -> dict[str, Any]:
    # Triton lists at least one dimension per sample; a scalar sample is [1] reshaped to [].
    document: dict[str, Any] = {
        "name": spec.name,
        "data_type": TRITON_TYPES[spec.datatype],
        "dims": list(spec.shape) or [1],
    }
    if not spec.shape:
        document["reshape"] = {"shape": []}
    if is_input:
        document["format"] = "FORMAT_NONE"
        document["optional"] = False
    return document


def model_configuration(model: ServedModel, settings: Settings) -> dict[str, Any]:
    """The model's configuration as Triton's ``GET /v2/models/{m}/config`` answers it: a Triton
    model folder's own (``triton_folder_configuration``), or one describing a nograd model.

    ``max_batch_size`` is the most rows one request may carry (``NOGRAD_MAX_REQUEST_ROWS``):
    what Triton's clients check a request against. nograd splits a larger-than-batch request
    itself, so the batcher's own limit, sized by measured memory, goes in ``parameters``.
    """
    config = model.config
    if config.triton_config is not None:
        return triton_folder_configuration(model)
    batcher = model.batcher
    delay_ms = config.max_queue_delay_ms
    if delay_ms is None:
        delay_ms = settings.max_queue_delay_ms
    queue_size = config.max_queue_size or settings.max_queue_size
    device = str(model.handler.device) if model.handler is not None else config.device
    parameters: dict[str, dict[str, str]] = {
        "batch_unit": {"string_value": config.batch_unit},
        "precision": {"string_value": config.precision},
    }
    if batcher is not None:
        parameters["batch_limit"] = {"string_value": str(batcher.limit.current)}
    return {
        "name": config.name,
        "platform": config.platform,
        "backend": "nograd",
        "version_policy": {"specific": {"versions": [int(config.version)]}}
        if config.version.isdigit()
        else {"latest": {"num_versions": 1}},
        "max_batch_size": settings.max_request_rows,
        "input": [_tensor(spec, is_input=True) for spec in config.inputs],
        "output": [_tensor(spec, is_input=False) for spec in config.outputs],
        "batch_input": [],
        "batch_output": [],
        "dynamic_batching": {
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": round(delay_ms * 1000),
            "preserve_ordering": False,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": round((settings.request_timeout_s or 0) * 1e6),
                "allow_timeout_override": True,
                "max_queue_size": queue_size,
            },
        },
        "instance_group": [
            {
                "name": f"{config.name}_0",
                "kind": "KIND_GPU" if device.startswith("cuda") else "KIND_CPU",
                "count": 1,
            }
        ],
        "parameters": parameters,
    }


def triton_folder_configuration(model: ServedModel) -> dict[str, Any]:
    """A Triton model folder's configuration as read from its ``config.pbtxt``, completed as
    Triton completes it: a Python model's as its ``auto_complete_config`` left it, inputs and
    outputs read from an ONNX model's file, with ``max_batch_size`` 4 for one that can batch
    and, as ONNX Runtime's backend adds it, dynamic batching, and the instance group it runs
    as."""
    config = model.config
    assert config.triton_config is not None
    document: dict[str, Any] = json.loads(config.triton_config)
    if config.backend == PYTHON.backend:
        document = completed_document(document)
    if not document.get("instance_group") and not config.steps:
        device = str(model.handler.device) if model.handler is not None else config.device
        # Triton names the group it adds after the model.
        document["instance_group"] = [
            {
                "name": config.name,
                "kind": "KIND_GPU" if device.startswith("cuda") else "KIND_CPU",
                "count": 1,
                "gpus": [int(device.partition(":")[2] or 0)] if device.startswith("cuda") else [],
                "secondary_devices": [],
                "profile": [],
                "passive": False,
                "host_policy": "",
            }
        ]
    max_batch_size = (config.max_batch_size or 0) if config.batch_dimension else 0
    # ONNX Runtime's auto-complete (a config without inputs or outputs) turns dynamic batching
    # on for a model that batches more than one row and has no scheduler of its own.
    completed = config.backend == ONNX.backend and not (
        document.get("input") and document.get("output")
    )
    scheduled = "dynamic_batching" in document or "sequence_batching" in document
    if completed and max_batch_size > 1 and not scheduled:
        document["dynamic_batching"] = {
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": 0,
            "preserve_ordering": False,
            "priority_levels": 0,
            "default_priority_level": 0,
            "priority_queue_policy": {},
        }
    batching = document.get("dynamic_batching")
    if batching is not None and max_batch_size > 0 and not batching.get("preferred_batch_size"):
        # Triton's NormalizeModelConfig, once the backend has set the batch size.
        batching["preferred_batch_size"] = [max_batch_size]
    document["max_batch_size"] = max_batch_size
    if not document.get("input"):
        document["input"] = [_completed(spec, is_input=True) for spec in config.inputs]
    if not document.get("output"):
        document["output"] = [_completed(spec, is_input=False) for spec in config.outputs]
    return document


def _completed(spec: TensorSpec, *, is_input: bool) -> dict[str, Any]:
    """A tensor Triton's auto-complete added, listed with the fields Triton prints."""
    document = _tensor(spec, is_input=is_input)
    document["is_shape_tensor"] = False
    document["is_non_linear_format_io"] = False
    if is_input:
        document["allow_ragged_batch"] = False
    else:
        document["label_filename"] = ""
    return document


def repository_index(
    rows: Sequence[ServedModel | tuple[str, str]], *, ready_only: bool = False
) -> list[dict[str, str]]:
    """Every model of the repository with its state, as Triton's repository index lists it:
    each version loaded or loading, and each model not loaded (name and reason, no version)."""
    index = []
    models = [row for row in rows if isinstance(row, ServedModel)]
    for model in sorted(models, key=lambda m: (m.name, version_order(m.version))):
        if ready_only and not model.ready:
            continue
        entry = {"name": model.name, "version": model.version, "state": INDEX_STATES[model.state]}
        if model.state is State.READY and not model.ready:
            entry["state"] = "UNAVAILABLE"
            waiting = model.waiting_for() if model.waiting_for is not None else None
            entry["reason"] = waiting or "its batch loop stopped; the watchdog restarts it"
        elif model.error:
            entry["reason"] = model.error
        index.append(entry)
    if not ready_only:
        for row in rows:
            if isinstance(row, tuple):
                state = "LOADING" if row[1] == LOADING_ON_DEMAND else "UNAVAILABLE"
                index.append({"name": row[0], "state": state, "reason": row[1]})
    return index
