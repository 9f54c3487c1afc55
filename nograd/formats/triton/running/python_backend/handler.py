"""A Triton Python-backend model (``model.py`` defining ``TritonPythonModel``) as the batcher's
runner: ``initialize`` at load, the batcher's requests handed to ``execute`` together, one response
per request, ``finalize`` when the version is freed.

Its ``execute`` is opaque code that may act on what it receives, so nograd runs it on requests
only (a ``RequestRunner``): no synthetic warm-up, memory profile or engine choice; its batch limit
is its config's ``max_batch_size``, which Triton holds it to as well.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Final, cast

import numpy as np
import torch

from nograd.core.datatypes import TABLE
from nograd.core.errors import ModelAnswered
from nograd.core.responses import Response
from nograd.formats.triton.running.python_backend import utils
from nograd.runtime.handler import Outputs, TensorPart
from nograd.runtime.runners import RequestRunner
from nograd.schema.config import ModelConfig, TensorSpec
from nograd.schema.sequence_config import state_outputs

UTILS_MODULE: Final = "triton_python_backend_utils"
"""The name Triton's Python models import the backend's utilities by."""
MODEL_CLASS: Final = "TritonPythonModel"
STATUS: Final[dict[int, int]] = {
    utils.TritonError.UNKNOWN: 400,
    utils.TritonError.INTERNAL: 500,
    utils.TritonError.NOT_FOUND: 404,
    utils.TritonError.INVALID_ARG: 400,
    utils.TritonError.UNAVAILABLE: 503,
    utils.TritonError.UNSUPPORTED: 501,
    utils.TritonError.ALREADY_EXISTS: 400,
    utils.TritonError.CANCELLED: 400,
}
"""A ``TritonError`` code's HTTP status, as Triton's HTTP front maps it."""
CODE_NAMES: Final[dict[int, str]] = {
    getattr(utils.TritonError, name): name
    for name in (
        *("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG"),
        *("UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS", "CANCELLED"),
    )
}
"""A ``TritonError`` code's name, which the gRPC front maps to its status code."""
DATATYPES: Final[dict[str, str]] = {row.triton: row.name for row in TABLE}


def register_utils() -> None:
    """Make ``import triton_python_backend_utils`` give nograd's implementation."""
    sys.modules[UTILS_MODULE] = utils


def model_class(code: Any, where: str) -> type:
    found = getattr(code, MODEL_CLASS, None)
    if not isinstance(found, type):
        raise ValueError(f"{where}: defines no class {MODEL_CLASS}")
    if not callable(getattr(found, "execute", None)):
        raise ValueError(f"{where}: {MODEL_CLASS} defines no execute(requests)")
    return found


def auto_completed(cls: type, config: ModelConfig) -> ModelConfig:
    """The config after the model's static ``auto_complete_config``, when it has one: the batch
    size, dynamic batching, inputs and outputs it sets, as Triton applies them."""
    complete = getattr(cls, "auto_complete_config", None)
    if complete is None or config.triton_config is None:
        return config
    result = complete(utils.ModelConfig(config.triton_config))
    document = result.as_dict() if isinstance(result, utils.ModelConfig) else None
    if document is None:
        raise ValueError("auto_complete_config must return the ModelConfig it was given")
    batched = int(document.get("max_batch_size", 0)) > 0
    fields: dict[str, Any] = {
        "triton_config": json.dumps(document, sort_keys=True),
        "inputs": tuple(_spec(tensor) for tensor in document["input"]),
        "outputs": tuple(_spec(tensor) for tensor in document["output"]),
        "batch_dimension": batched,
        "max_batch_size": int(document["max_batch_size"]) if batched else 1,
    }
    if "dynamic_batching" in document and config.max_queue_delay_ms == 0:
        delay = document["dynamic_batching"].get("max_queue_delay_microseconds", 0)
        fields["max_queue_delay_ms"] = int(delay) / 1000
    return ModelConfig.model_validate({**config.model_dump(), **fields})


def _spec(tensor: Mapping[str, Any]) -> TensorSpec:
    datatype = DATATYPES.get(str(tensor["data_type"]))
    if datatype is None:
        raise ValueError(f"tensor {tensor['name']!r}: data_type {tensor['data_type']} is unknown")
    shape = tuple(int(d) for d in tensor["dims"])
    return TensorSpec(name=str(tensor["name"]), datatype=datatype, shape=shape)


class PythonBackendHandler(RequestRunner):
    """Runs a ``TritonPythonModel``: each request of a batch an ``InferenceRequest`` of its own
    tensors (BYTES as object arrays of bytes, never through torch)."""

    def __init__(
        self, model: Any, config: ModelConfig, device: torch.device, model_dir: str
    ) -> None:
        super().__init__(config, device)
        self.model = model
        kind = "GPU" if device.type == "cuda" else "CPU"
        self.args = {
            "model_config": config.triton_config or "{}",
            "model_instance_kind": kind,
            "model_instance_name": f"{config.name}_0_0",
            "model_instance_device_id": str(device.index or 0),
            "model_repository": model_dir,
            "model_version": config.version,
            "model_name": config.name,
        }

    def initialize(self) -> None:
        initialize = getattr(self.model, "initialize", None)
        if initialize is not None:
            initialize(dict(self.args))

    def run_batch(self, parts: Sequence[TensorPart]) -> list[Outputs]:
        """One ``execute`` over every part, each part one request; an error response, or
        ``execute`` raising, fails those requests with the model's own message (the exception
        in a request's place answers that request alone)."""
        return cast(list[Outputs], self._execute(parts))

    def _execute(self, parts: Sequence[TensorPart]) -> list[Outputs | BaseException]:
        unbatched = self.config.batch_dimension is False
        declared = self.config.outputs + state_outputs(self.config.sequence)
        outputs = [spec.name for spec in declared]
        version = int(self.config.version) if self.config.version.isdigit() else -1
        requests = [
            utils.InferenceRequest(
                [
                    utils.Tensor(name, array[0] if unbatched else array)
                    for name, array in part.tensors.items()
                ],
                outputs,
                model_name=self.config.name,
                model_version=version,
                sender=self._sender(part.responder) if self.config.decoupled else None,
                correlation_id=0 if part.sequence is None else part.sequence.correlation_id,
                flags=0 if part.sequence is None else part.sequence.flags,
            )
            for part in parts
        ]
        try:
            responses = self.model.execute(requests)
            if inspect.iscoroutine(responses):
                responses = asyncio.run(responses)
            if self.config.decoupled:
                # Its responses go through each request's sender, now or later, from any thread.
                return [{} for _ in parts]
            responses = list(responses)
            if len(responses) != len(requests):
                raise utils.TritonModelException(
                    f"execute returned {len(responses)} response(s) for {len(requests)} "
                    "request(s); it must return one per request"
                )
        except Exception as exc:
            failure = ModelAnswered(
                f"Failed to process the request(s) for model '{self.config.name}', "
                f"message: {type(exc).__name__}: {exc}",
                500,
            )
            return [failure for _ in parts]
        return [self._answer(response, unbatched) for response in responses]

    def _sender(self, responder: Any) -> utils.InferenceResponseSender:
        """A request's response sender, putting each response on the request's stream."""
        if responder is None:
            raise utils.TritonModelException(
                "a decoupled model answers over the streaming call (gRPC ModelStreamInfer) only"
            )

        def send(response: Any, final: bool) -> None:
            if response is None:
                responder.put(Response(None, None, final))
                return
            answer = self._answer(response, unbatched=False)
            if isinstance(answer, BaseException):
                responder.put(Response(None, answer, final))
            else:
                responder.put(Response(answer, None, final))

        return utils.InferenceResponseSender(send)

    def _answer(self, response: Any, unbatched: bool) -> Outputs | BaseException:
        if not isinstance(response, utils.InferenceResponse):
            return ModelAnswered(
                f"Failed to process the request(s) for model '{self.config.name}', message: "
                f"execute returned {type(response).__name__}, not an InferenceResponse",
                500,
            )
        error = response.error()
        if error is not None:
            code = error.code() if error.code() in STATUS else utils.TritonError.INTERNAL
            return ModelAnswered(error.message(), STATUS[code], CODE_NAMES[code])
        answer: Outputs = {}
        for tensor in response.output_tensors():
            array = np.asarray(tensor.as_numpy())
            answer[tensor.name()] = array[np.newaxis] if unbatched else array
        return answer

    def close(self) -> None:
        finalize = getattr(self.model, "finalize", None)
        if finalize is not None:
            finalize()
