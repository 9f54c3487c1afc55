"""The Open Inference Protocol's gRPC service (``inference.GRPCInferenceService``), with the
Triton extension RPCs its clients and tools call: thin, like the HTTP routes; every call goes
through the same serving core, so one batch may mix HTTP and gRPC requests. Served over
``nograd.grpc.rpc``; an RPC of the service not defined here answers UNIMPLEMENTED."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message

from nograd.core.responses import ResponseQueue
from nograd.formats.triton.api.documents import model_configuration, repository_index
from nograd.formats.triton.reading.generated import model_config_pb2
from nograd.grpc.diagnostics import DiagnosticsRpcs, trace_parent
from nograd.grpc.failures import client_message, status_code
from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.grpc.rpc import CallContext
from nograd.grpc.shared_memory import SharedMemoryRpcs
from nograd.grpc.stream_infer import StreamInferRpcs
from nograd.grpc.tensors import (
    class_counts,
    encode_outputs,
    plain,
    read_inputs,
    sequence_parameters,
)
from nograd.grpc.versions import requested_version
from nograd.protocol.request_timeout import PARAMETER as TIMEOUT
from nograd.protocol.request_timeout import timeout_s
from nograd.serving import documents
from nograd.serving.access import LOGGING, MODEL_REPOSITORY, SHARED_MEMORY, TRACE
from nograd.serving.calls import Call, classified
from nograd.serving.control_calls import load_model, unload_parameters
from nograd.serving.core import Core
from nograd.serving.errors import (
    DeadlineExceeded,
    Kind,
    ModelNotFound,
    kind_of,
    retry_after_s,
)
from nograd.serving.sequences import Place, sequence_request

logger = logging.getLogger(__name__)
PROTOCOL: Final = "grpc"
EXTENSIONS: Final = list(documents.EXTENSIONS)
METHOD_PREFIX: Final = "/inference.GRPCInferenceService/"


OPERATOR_RPCS: Final = {
    "RepositoryIndex": MODEL_REPOSITORY,
    "RepositoryModelLoad": MODEL_REPOSITORY,
    "RepositoryModelUnload": MODEL_REPOSITORY,
    "SystemSharedMemoryStatus": SHARED_MEMORY,
    "SystemSharedMemoryRegister": SHARED_MEMORY,
    "SystemSharedMemoryUnregister": SHARED_MEMORY,
    "CudaSharedMemoryStatus": SHARED_MEMORY,
    "CudaSharedMemoryRegister": SHARED_MEMORY,
    "CudaSharedMemoryUnregister": SHARED_MEMORY,
    "TraceSetting": TRACE,
    "LogSettings": LOGGING,
}
"""The RPCs of each operator API group (``nograd.serving.access``), as HTTP's routes of it."""

Reply = TypeVar("Reply", bound=Message)
Unary = Callable[[Any, CallContext], Awaitable[Any]]


class InferenceService(DiagnosticsRpcs, SharedMemoryRpcs, StreamInferRpcs):
    def __init__(self, core: Core, *, protect_health: bool) -> None:
        self._core = core
        self._calls = core.calls
        self._plane = core.plane
        self._control = core.control
        self._protect_health = protect_health
        self._max_queued_responses = core.settings.max_queued_responses

    # ------------------------------------------------------------------ plumbing
    def authorize(
        self, context: CallContext, model: str | None = None, group: str | None = None
    ) -> None:
        """The call's ``authorization`` metadata checked for API ``group`` (``Unauthenticated``
        or ``Forbidden`` when wrong); the health service uses it too when
        ``NOGRAD_AUTH_HEALTH`` is set."""
        values = [v for k, v in context.invocation_metadata() if k == "authorization"]
        self._calls.authorize(values, PROTOCOL, model, group)

    def restricted(self, name: str, rpc: Unary) -> Unary:
        """``rpc`` (the service's method ``name``), refused unless the call's key opens its
        operator API group (``OPERATOR_RPCS``), before its request is looked at; any other RPC
        as it is."""
        group = OPERATOR_RPCS.get(name)
        if group is None:
            return rpc

        async def gated(request: Any, context: CallContext) -> Any:
            try:
                self.authorize(context, group=group)
            except Exception as exc:
                await self._abort(context, exc, kind_of(exc))
                raise
            return await rpc(request, context)

        return gated

    def _caller(self, context: CallContext) -> str:
        """Whose call this is (``Calls.caller``: the id of the API key it carries)."""
        values = [v for k, v in context.invocation_metadata() if k == "authorization"]
        return self._calls.caller(values)

    async def _abort(self, context: CallContext, exc: BaseException, kind: Kind) -> None:
        """End the call with the kind's code and a message fit for the client; a transient
        refusal says when to retry (trailing metadata ``retry-after``)."""
        if kind is Kind.UNAVAILABLE:
            context.set_trailing_metadata((("retry-after", str(retry_after_s(exc))),))
        await context.abort(status_code(exc, kind), client_message(exc, kind))

    async def _answer(
        self,
        context: CallContext,
        work: Callable[[], Awaitable[Reply]],
        *,
        health: bool = False,
    ) -> Reply:
        """Check the key, run ``work``, and answer a failure with its code and a clear message."""
        try:
            if self._protect_health or not health:
                self.authorize(context)
            return await work()
        except Exception as exc:
            kind = kind_of(exc)
            if kind is Kind.FAILED:
                logger.exception("gRPC call failed")
            await self._abort(context, exc, kind)
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
        """Triton's answer: a model (or version) not served is not ready, with status OK (the
        clients' ``is_model_ready`` returns False); a version that is no number is
        INVALID_ARGUMENT. It names the models served, so it needs a key as HTTP's
        ``/v2/models/{m}/ready`` does."""

        async def ready() -> pb.ModelReadyResponse:
            version = requested_version(request.version)
            try:
                model = self._plane.get(request.name, version)
            except ModelNotFound:
                return pb.ModelReadyResponse(ready=False)
            return pb.ModelReadyResponse(ready=model.ready)

        return await self._answer(context, ready)

    async def ServerMetadata(self, request: Any, context: CallContext) -> pb.ServerMetadataResponse:
        async def metadata() -> pb.ServerMetadataResponse:
            settings = self._plane.settings
            document = documents.server_metadata(
                settings.server_name, EXTENSIONS, shared_memory=settings.shared_memory
            )
            return _message(document, pb.ServerMetadataResponse())

        return await self._answer(context, metadata)

    async def ModelMetadata(self, request: Any, context: CallContext) -> pb.ModelMetadataResponse:
        async def metadata() -> pb.ModelMetadataResponse:
            model = self._calls.described(request.name, requested_version(request.version))
            document = documents.model_metadata(self._plane, model)
            return _message(document, pb.ModelMetadataResponse())

        return await self._answer(context, metadata)

    async def ModelConfig(self, request: Any, context: CallContext) -> pb.ModelConfigResponse:
        async def config() -> pb.ModelConfigResponse:
            model = self._calls.described(request.name, requested_version(request.version))
            document = model_configuration(model, self._plane.settings)
            return pb.ModelConfigResponse(config=_message(document, model_config_pb2.ModelConfig()))

        return await self._answer(context, config)

    async def ModelStatistics(
        self, request: Any, context: CallContext
    ) -> pb.ModelStatisticsResponse:
        async def statistics() -> pb.ModelStatisticsResponse:
            version = requested_version(request.version)
            document = documents.statistics(self._plane, request.name or None, version)
            return _message(document, pb.ModelStatisticsResponse())

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
            await load_model(self._control, request.model_name, parameters)
            return pb.RepositoryModelLoadResponse()

        return await self._answer(context, load)

    async def RepositoryModelUnload(
        self, request: Any, context: CallContext
    ) -> pb.RepositoryModelUnloadResponse:
        async def unload() -> pb.RepositoryModelUnloadResponse:
            parameters = {
                key: value.bool_param if value.HasField("bool_param") else value.string_param
                for key, value in request.parameters.items()
            }
            await self._control.unload(request.model_name, unload_parameters(parameters))
            return pb.RepositoryModelUnloadResponse()

        return await self._answer(context, unload)

    # ------------------------------------------------------------------ inference
    async def ModelInfer(self, request: Any, context: CallContext) -> pb.ModelInferResponse:
        calls = self._calls
        call = calls.open(PROTOCOL, METHOD_PREFIX + "ModelInfer")
        call.model = calls.label(request.model_name)
        kind: Kind | None = Kind.CLIENT_GONE  # unless answered: the client left, or a shutdown
        try:
            response = await self._infer(call, request, context)
            kind = None
            return response
        except Exception as exc:
            kind = calls.failed(call, exc)
            await self._abort(context, exc, kind)
            raise  # abort raises; this line only satisfies the type checker
        finally:
            calls.close(call, 200 if kind is None else kind.status)

    async def _infer(
        self,
        call: Call,
        request: Any,
        context: CallContext,
        responder: ResponseQueue | None = None,
        place: Place | None = None,
    ) -> pb.ModelInferResponse:
        """One inference request, ModelInfer's or a stream's (whose sequence ``place`` it
        keeps)."""
        calls = self._calls
        self.authorize(context, request.model_name)
        calls.admit(request.model_name)
        call.trace_parent = trace_parent(context)
        try:
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded("the call's deadline (grpc-timeout) passed before it ran")
            call.timeout_s = remaining
            # Triton's ``timeout`` parameter: the request's deadline, before its model loads.
            call.shorten_deadline(timeout_s(plain(request.parameters).get(TIMEOUT)))
            sequence = sequence_request(sequence_parameters(request))
            name, version = request.model_name, requested_version(request.model_version)
            await calls.resident(call, name)
            # Checked against the model's declared inputs before any value is read.
            check = calls.input_check(call, name, version, request.id or None)
            regions = calls.regions(call, self._caller(context))
            inputs = await read_inputs(request, check, regions)
            model, outputs = await calls.infer(
                call,
                name,
                version,
                inputs,
                request.id or None,
                responder=responder,
                sequence=sequence,
                place=place,
            )
            response = pb.ModelInferResponse(
                model_name=model.name, model_version=model.version, id=request.id
            )
            if responder is not None:
                return response  # a decoupled model's outputs come with each of its responses
            counts = class_counts(request)
            encode_outputs(response, classified(model, outputs, counts), request.outputs, regions)
            return response
        finally:
            calls.release()


def _message(document: dict[str, Any], message: Reply) -> Reply:
    """A protobuf message from the JSON document of the same fields."""
    json_format.ParseDict(document, message, ignore_unknown_fields=True)
    return message
