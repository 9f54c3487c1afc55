"""The Open Inference Protocol's gRPC service (``inference.GRPCInferenceService``), with the
Triton extension RPCs its clients and tools call: thin, like the HTTP routes; every call goes to
the same data plane, so one batch may mix HTTP and gRPC requests. Served over
``nograd.grpc.rpc``; an RPC of the service not defined here answers UNIMPLEMENTED."""

from __future__ import annotations

import hmac
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar

from google.protobuf import json_format

from nograd import __version__
from nograd.batching import BatcherClosed, DeadlineExceeded, QueueFull, SampleTooLarge
from nograd.core.errors import DecodeError
from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.grpc.generated import model_config_pb2
from nograd.grpc.rpc import CallContext, Code
from nograd.grpc.tensors import decode_inputs, encode_outputs
from nograd.observability.metrics import UNKNOWN_MODEL, Metrics
from nograd.serving.control import ControlRefused, LoadFailed, ModelControl, load_parameters
from nograd.serving.dataplane import DataPlane
from nograd.serving.errors import (
    InferenceFailed,
    InvalidInput,
    LimitExceeded,
    ModelNotFound,
    ModelNotReady,
)
from nograd.serving.triton_config import model_configuration, repository_index

logger = logging.getLogger(__name__)
PROTOCOL: Final = "grpc"
EXTENSIONS: Final = ["model_configuration", "model_repository", "statistics"]

CODES: Final[list[tuple[type[Exception], Code, int]]] = [
    (DecodeError, Code.INVALID_ARGUMENT, 400),
    (InvalidInput, Code.INVALID_ARGUMENT, 400),
    (LimitExceeded, Code.RESOURCE_EXHAUSTED, 422),
    (ModelNotFound, Code.NOT_FOUND, 404),
    (ModelNotReady, Code.UNAVAILABLE, 503),
    (QueueFull, Code.UNAVAILABLE, 503),
    (BatcherClosed, Code.UNAVAILABLE, 503),
    (DeadlineExceeded, Code.DEADLINE_EXCEEDED, 504),
    (SampleTooLarge, Code.RESOURCE_EXHAUSTED, 507),
    (InferenceFailed, Code.INTERNAL, 500),
]
"""Each failure's gRPC code and the HTTP status it answers over HTTP (the metrics' ``code``)."""

Reply = TypeVar("Reply")


def code_of(exc: BaseException) -> tuple[Code, int]:
    for kind, code, status in CODES:
        if isinstance(exc, kind):
            return code, status
    return Code.INTERNAL, 500


class InferenceService:
    def __init__(
        self,
        plane: DataPlane,
        control: ModelControl,
        metrics: Metrics,
        api_keys: Sequence[str],
        *,
        protect_health: bool,
    ) -> None:
        self._plane = plane
        self._control = control
        self._metrics = metrics
        self._keys = [key.encode() for key in api_keys]
        self._protect_health = protect_health

    # ------------------------------------------------------------------ plumbing
    def _check_key(self, context: CallContext) -> None:
        if not self._keys:
            return
        values = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
        given = values[0].encode() if len(values) == 1 and isinstance(values[0], str) else b""
        token = given[7:] if given[:7].lower() == b"bearer " else b""
        if not any(hmac.compare_digest(token, key) for key in self._keys):
            self._metrics.rejected.labels(UNKNOWN_MODEL, "unauthorized").inc()
            why = "missing" if not values else "invalid"
            raise Unauthenticated(f"{why} API key: send metadata 'authorization: Bearer <key>'")

    async def _answer(
        self,
        context: CallContext,
        work: Callable[[], Awaitable[Reply]],
        record: Callable[[int], None] | None = None,
        *,
        health: bool = False,
    ) -> Reply:
        """Check the key, run ``work``, and answer a failure with its code and a clear message
        (``record`` hears the HTTP-equivalent status first)."""
        try:
            if self._protect_health or not health:
                self._check_key(context)
            return await work()
        except Exception as exc:
            code, status = code_of(exc)
            if record is not None:
                record(status)
            if status == 503:
                seconds = exc.retry_after_s if isinstance(exc, QueueFull) else 1.0
                context.set_trailing_metadata((("retry-after", str(max(1, math.ceil(seconds)))),))
            if status >= 500 and status not in (503, 504, 507):
                logger.exception("gRPC call failed")
            await context.abort(code, str(exc))
            raise  # abort raises; this line only satisfies the type checker

    # ------------------------------------------------------------------ health and metadata
    async def ServerLive(self, request: Any, context: CallContext) -> pb.ServerLiveResponse:
        return await self._answer(context, self._live, health=True)

    async def _live(self) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: CallContext) -> pb.ServerReadyResponse:
        async def ready() -> pb.ServerReadyResponse:
            return pb.ServerReadyResponse(ready=self._plane.ready())

        return await self._answer(context, ready, health=True)

    async def ModelReady(self, request: Any, context: CallContext) -> pb.ModelReadyResponse:
        async def ready() -> pb.ModelReadyResponse:
            try:
                model = self._plane.get(request.name, request.version or None)
            except ModelNotFound:
                return pb.ModelReadyResponse(ready=False)
            return pb.ModelReadyResponse(ready=model.ready)

        return await self._answer(context, ready, health=True)

    async def ServerMetadata(self, request: Any, context: CallContext) -> pb.ServerMetadataResponse:
        async def metadata() -> pb.ServerMetadataResponse:
            return pb.ServerMetadataResponse(
                name="nograd", version=__version__, extensions=EXTENSIONS
            )

        return await self._answer(context, metadata)

    async def ModelMetadata(self, request: Any, context: CallContext) -> pb.ModelMetadataResponse:
        async def metadata() -> pb.ModelMetadataResponse:
            model = self._plane.get(request.name, request.version or None)
            config = model.config
            tensor = pb.ModelMetadataResponse.TensorMetadata
            return pb.ModelMetadataResponse(
                name=config.name,
                versions=self._plane.registry.version_names(config.name),
                platform=config.platform,
                inputs=[
                    tensor(name=s.name, datatype=s.datatype, shape=[-1, *(s.shape or (1,))])
                    for s in config.inputs
                ],
                outputs=[
                    tensor(name=s.name, datatype=s.datatype, shape=[-1, *s.shape])
                    for s in config.outputs
                ],
            )

        return await self._answer(context, metadata)

    async def ModelConfig(self, request: Any, context: CallContext) -> pb.ModelConfigResponse:
        async def config() -> pb.ModelConfigResponse:
            model = self._plane.get(request.name, request.version or None)
            document = model_configuration(model, self._plane.settings)
            message = model_config_pb2.ModelConfig()
            json_format.ParseDict(document, message, ignore_unknown_fields=True)
            return pb.ModelConfigResponse(config=message)

        return await self._answer(context, config)

    async def ModelStatistics(
        self, request: Any, context: CallContext
    ) -> pb.ModelStatisticsResponse:
        async def statistics() -> pb.ModelStatisticsResponse:
            if request.name:
                models = [self._plane.get(request.name, request.version or None)]
            else:
                models = list(self._plane.models.values())
            document = {
                "model_stats": [
                    self._plane.statistics.of(m.name).document(m.name, m.version) for m in models
                ]
            }
            response = pb.ModelStatisticsResponse()
            json_format.ParseDict(document, response, ignore_unknown_fields=True)
            return response

        return await self._answer(context, statistics)

    # ------------------------------------------------------------------ repository
    async def RepositoryIndex(
        self, request: Any, context: CallContext
    ) -> pb.RepositoryIndexResponse:
        async def index() -> pb.RepositoryIndexResponse:
            entries = repository_index(self._control.index(), ready_only=request.ready)
            model = pb.RepositoryIndexResponse.ModelIndex
            return pb.RepositoryIndexResponse(models=[model(**entry) for entry in entries])

        return await self._answer(context, index)

    async def RepositoryModelLoad(
        self, request: Any, context: CallContext
    ) -> pb.RepositoryModelLoadResponse:
        async def load() -> pb.RepositoryModelLoadResponse:
            parameters = {
                key: value.string_param if value.HasField("string_param") else value.bytes_param
                for key, value in request.parameters.items()
            }
            override = load_parameters(parameters)
            await self._control.load(request.model_name, override)
            return pb.RepositoryModelLoadResponse()

        return await self._answer(context, load)

    async def RepositoryModelUnload(
        self, request: Any, context: CallContext
    ) -> pb.RepositoryModelUnloadResponse:
        async def unload() -> pb.RepositoryModelUnloadResponse:
            await self._control.unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()

        return await self._answer(context, unload)

    # ------------------------------------------------------------------ inference
    async def ModelInfer(self, request: Any, context: CallContext) -> pb.ModelInferResponse:
        started = time.perf_counter()
        label = request.model_name if request.model_name in self._plane.models else UNKNOWN_MODEL
        status = [499]  # cancelled unless answered: the client left, or its deadline passed

        def record(code: int) -> None:
            status[0] = code

        self._metrics.inflight.inc()
        try:
            response = await self._answer(context, lambda: self._infer(request, context), record)
            status[0] = 200
            return response
        finally:
            self._metrics.inflight.dec()
            self._metrics.request_done(label, PROTOCOL, status[0], time.perf_counter() - started)

    async def _infer(self, request: Any, context: CallContext) -> pb.ModelInferResponse:
        plane = self._plane
        try:
            plane.admit(request.model_name)
        except QueueFull as exc:
            label = request.model_name if request.model_name in plane.models else UNKNOWN_MODEL
            self._metrics.rejected.labels(label, exc.reason).inc()
            raise
        try:
            remaining = context.time_remaining()
            timeout_s = remaining if remaining is not None and remaining > 0 else None
            parameter = request.parameters.get("timeout")
            if parameter is not None and parameter.int64_param > 0:
                timeout_s = min(timeout_s or math.inf, parameter.int64_param / 1e6)
            inputs = decode_inputs(request)
            model, outputs = await plane.infer(
                request.model_name, request.model_version or None, inputs, timeout_s=timeout_s
            )
            response = pb.ModelInferResponse(
                model_name=model.name, model_version=model.version, id=request.id
            )
            encode_outputs(response, outputs, [o.name for o in request.outputs])
            return response
        finally:
            plane.release()


class Unauthenticated(Exception):
    """No valid API key in the call's metadata."""


CODES[:0] = [
    (Unauthenticated, Code.UNAUTHENTICATED, 401),
    (ControlRefused, Code.FAILED_PRECONDITION, 400),
    (LoadFailed, Code.FAILED_PRECONDITION, 400),
]
