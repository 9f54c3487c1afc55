"""Open Inference Protocol (KServe V2) REST routes: thin; decode, call the data plane, encode."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, Final

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from nograd.http.error_bodies import error_body, error_headers
from nograd.http.exchange import (
    CallHead,
    Incoming,
    caller_of,
    encoded_reply,
    hold_decoded,
    inflated_body,
    parse_measured,
    run_call,
    run_head_call,
)
from nograd.http.reply import Reply, answer_reply
from nograd.http.state import calls_of, dataplane_of
from nograd.protocol import binary
from nograd.protocol import shared_memory as shm
from nograd.protocol.limits import OFFLOAD_DECODE_BYTES
from nograd.protocol.request_timeout import PARAMETER as TIMEOUT
from nograd.protocol.request_timeout import timeout_s
from nograd.protocol.v2 import (
    InferRequest,
    declared_inputs,
    decode_document,
    dumps,
    parse_json,
    select_outputs,
    split_body,
)
from nograd.protocol.v2_handover import Answer, Predecoded
from nograd.protocol.v2_schemas import (
    ERROR_RESPONSES,
    INFER_REQUEST_BODY,
    InferResponse,
    LiveResponse,
    ModelMetadata,
    ModelReadyResponse,
    ReadyResponse,
    ServerMetadata,
    StatisticsResponse,
)
from nograd.serving.calls.lifecycle import Call, Calls, classified
from nograd.serving.calls.validation import Declared
from nograd.serving.dataplane import DataPlane
from nograd.serving.extensions import documents
from nograd.serving.extensions.sequences import sequence_request
from nograd.serving.registry import ServedModel

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v2", tags=["Open Inference Protocol"])
PROTOCOL = "v2"
EXTENSIONS = sorted(["binary_tensor_data", *documents.EXTENSIONS])


def json_response(document: Any, status: int = 200) -> Response:
    return Response(content=dumps(document), status_code=status, media_type="application/json")


@router.get("", response_model=ServerMetadata, summary="Server metadata")
async def server_metadata(request: Request) -> ServerMetadata:
    settings = dataplane_of(request).settings
    document = documents.server_metadata(
        settings.server_name, EXTENSIONS, shared_memory=settings.shared_memory
    )
    return ServerMetadata.model_validate(document)


@router.get("/health/live", response_model=LiveResponse, summary="Liveness")
async def live() -> LiveResponse:
    return LiveResponse(live=True)


@router.get(
    "/health/ready",
    response_model=ReadyResponse,
    summary="Readiness: every model loaded and serving",
    responses={503: {"model": ReadyResponse, "description": "Not ready"}},
)
async def ready(request: Request) -> Response:
    is_ready = dataplane_of(request).ready()
    return json_response({"ready": is_ready}, 200 if is_ready else 503)


def _statistics(plane: DataPlane, name: str | None, version: str | None) -> StatisticsResponse:
    return StatisticsResponse.model_validate(documents.statistics(plane, name, version))


@router.get(
    "/models/stats",
    response_model=StatisticsResponse,
    summary="Statistics of every model (statistics extension)",
)
async def all_statistics(request: Request) -> StatisticsResponse:
    return _statistics(dataplane_of(request), None, None)


@router.get(
    "/models/{name}/stats",
    response_model=StatisticsResponse,
    summary="Model statistics (statistics extension)",
    responses=ERROR_RESPONSES,
)
async def model_statistics(request: Request, name: str) -> StatisticsResponse:
    return _statistics(dataplane_of(request), name, None)


@router.get(
    "/models/{name}/versions/{version}/stats",
    response_model=StatisticsResponse,
    summary="Model version statistics (statistics extension)",
    responses=ERROR_RESPONSES,
)
async def model_version_statistics(request: Request, name: str, version: str) -> StatisticsResponse:
    return _statistics(dataplane_of(request), name, version)


@router.get(
    "/models/{name}",
    response_model=ModelMetadata,
    summary="Model metadata",
    responses=ERROR_RESPONSES,
)
async def model_metadata(request: Request, name: str) -> ModelMetadata:
    model = calls_of(request).described(name)
    return ModelMetadata.model_validate(documents.model_metadata(dataplane_of(request), model))


@router.get(
    "/models/{name}/versions/{version}",
    response_model=ModelMetadata,
    summary="Model version metadata",
    responses=ERROR_RESPONSES,
)
async def model_version_metadata(request: Request, name: str, version: str) -> ModelMetadata:
    model = calls_of(request).described(name, version)
    return ModelMetadata.model_validate(documents.model_metadata(dataplane_of(request), model))


def _model_ready(request: Request, name: str, version: str | None) -> Response:
    model = calls_of(request).described(name, version)
    if model.ready:
        return Response(status_code=200)  # as Triton: the status is the answer
    return json_response({"name": model.name, "ready": False}, 503)


@router.get(
    "/models/{name}/ready",
    response_model=ModelReadyResponse,
    summary="Model readiness",
    responses={**ERROR_RESPONSES, 503: {"model": ModelReadyResponse}},
)
async def model_ready(request: Request, name: str) -> Response:
    return _model_ready(request, name, None)


@router.get(
    "/models/{name}/versions/{version}/ready",
    response_model=ModelReadyResponse,
    summary="Model version readiness",
    responses={**ERROR_RESPONSES, 503: {"model": ModelReadyResponse}},
)
async def model_version_ready(request: Request, name: str, version: str) -> Response:
    return _model_ready(request, name, version)


async def _decode(
    incoming: Incoming,
    calls: Calls,
    call: Call,
    resident: Callable[[Any], Awaitable[None]],
    check_for: Callable[[str | None], Callable[[Declared], None]],
    regions: shm.Regions,
) -> InferRequest:
    """The request, inflated if compressed (``inflated_body``), its JSON measured before it is
    parsed (``parse_measured``), its model made ``resident`` (told the parsed document, whose
    parameters may hold a deadline) and the inputs it declares checked against the model
    (``check_for`` the request's own id) before any tensor is built or a byte of the binary
    part read; inputs in shared memory are read from ``regions``."""
    body = await inflated_body(incoming, calls, call)
    header, data = split_body(body, incoming.headers.get(binary.HEADER_LENGTH.lower()))
    document = await parse_measured(calls, call, header, parse_json)
    await resident(document)
    given_id = document.get("id") if isinstance(document, dict) else None
    check_for(given_id if isinstance(given_id, str) else None)(declared_inputs(document))
    placed, unsized = shm.placed_bytes(_placed_inputs(document))
    if unsized:
        regions.hold(unsized)
    # Milliseconds of CPU, or a large copy out of shared memory: off the event loop.
    if len(body) + placed > OFFLOAD_DECODE_BYTES:
        return await run_in_threadpool(decode_document, document, data, regions)
    return decode_document(document, data, regions)


async def _predecoded(
    predecoded: Predecoded,
    calls: Calls,
    call: Call,
    resident: Callable[[Any], Awaitable[None]],
    check_for: Callable[[str | None], Callable[[Declared], None]],
) -> InferRequest:
    """A request its front process decoded (``Predecoded``), taking ``_decode``'s steps in the
    same order on what the front measured."""
    hold_decoded(calls, call, predecoded.json_bytes)
    await resident({"parameters": predecoded.parameters})
    check_for(predecoded.request.id)(predecoded.declared)
    return predecoded.request


def _placed_inputs(document: Any) -> list[tuple[Any, Mapping[str, Any]]]:
    """Each input of a request document with parameters, as (datatype, parameters) as sent (no
    check: decoding checks them)."""
    inputs = document.get("inputs") if isinstance(document, dict) else None
    if not isinstance(inputs, list):
        return []
    tensors = [item for item in inputs if isinstance(item, dict)]
    each = ((tensor.get("datatype"), tensor.get("parameters")) for tensor in tensors)
    return [(datatype, parameters) for datatype, parameters in each if isinstance(parameters, dict)]


ENSEMBLE_PARAMETERS: Final = {"sequence_id": 0, "sequence_start": False, "sequence_end": False}


def _answer(model: ServedModel, decoded: InferRequest, outputs: Mapping[str, np.ndarray]) -> Answer:
    """The outputs the request asks for; one asked for by classification answers its top
    classes."""
    selected = select_outputs(list(outputs), decoded.outputs, decoded.parameters)
    counts = {output.name: output.classification for output in selected if output.classification}
    return Answer(
        model.name,
        model.version,
        classified(model, outputs, counts),
        tuple(selected),
        decoded.id,
        # Triton's ensembles answer with the sequence parameters of the request they composed.
        ENSEMBLE_PARAMETERS if model.config.steps else None,
    )


def _error_reply(status: int, exc: Exception) -> Reply:
    return Reply(status, error_body(str(exc)), headers=error_headers(status, exc))


Decode = Callable[
    [Call, Callable[[Any], Awaitable[None]], Callable[[str | None], Callable[[Declared], None]]],
    Awaitable[InferRequest],
]
"""How a call's request is decoded: given the call, ``resident`` and ``check_for``."""


def _infer_work(
    calls: Calls,
    name: str,
    version: str | None,
    decode: Decode,
    finish: Callable[[Answer], Reply],
) -> Callable[[Call], Awaitable[Reply]]:
    """One V2 inference's work on the serving core, its request as ``decode`` gives it and its
    answer as ``finish`` makes it a reply."""

    async def work(call: Call) -> Reply:
        async def resident(document: Any) -> None:
            # Triton's ``timeout`` parameter: the request's deadline, before its model loads.
            parameters = document.get("parameters") if isinstance(document, dict) else None
            if isinstance(parameters, dict):
                call.shorten_deadline(timeout_s(parameters.get(TIMEOUT)))
            await calls.resident(call, name)
            call.model = calls.label(name)

        call.model = calls.label(name)
        decoded = await decode(
            call, resident, lambda given_id: calls.input_check(call, name, version, given_id)
        )
        call.adopt_request_id(decoded.id)
        sequence = sequence_request(decoded.parameters)
        model, outputs = await calls.infer(
            call, name, version, decoded.inputs, decoded.id, sequence=sequence
        )
        return finish(_answer(model, decoded, outputs))

    return work


async def infer_call(incoming: Incoming, calls: Calls, name: str, version: str | None) -> Reply:
    """One V2 inference call; served by ``nograd.http.direct`` ahead of the router, and by the
    routes."""
    regions: shm.Regions | None = None

    async def decode(
        call: Call,
        resident: Callable[[Any], Awaitable[None]],
        check_for: Callable[[str | None], Callable[[Declared], None]],
    ) -> InferRequest:
        nonlocal regions
        regions = calls.regions(call, caller_of(calls, incoming.scope))
        return await _decode(incoming, calls, call, resident, check_for, regions)

    def finish(answer: Answer) -> Reply:
        return answer_reply(answer, regions)

    work = _infer_work(calls, name, version, decode, finish)
    reply = await run_call(incoming, calls, PROTOCOL, work, _error_reply)
    return await encoded_reply(incoming, reply)


async def decoded_infer_call(
    calls: Calls,
    head: CallHead,
    name: str,
    version: str | None,
    predecoded: Predecoded,
    left: Callable[[], bool],
) -> Reply:
    """A V2 inference call its front process decoded (``nograd.http.decoded``): the steps of
    ``infer_call`` on the decoded request, its answer left unencoded for the front
    (``Reply.answer``); ``left()`` says whether a cancellation is its client leaving."""

    def finish(answer: Answer) -> Reply:
        return Reply(200, answer=answer)

    work = _infer_work(calls, name, version, partial(_predecoded, predecoded, calls), finish)
    return await run_head_call(calls, PROTOCOL, head, work, _error_reply, left)


async def _routed_infer(request: Request, name: str, version: str | None) -> Response:
    incoming = Incoming(request.scope, request.receive)
    reply = await infer_call(incoming, calls_of(request), name, version)
    return reply.response()


@router.post(
    "/models/{name}/infer",
    response_model=InferResponse,
    summary="Inference",
    openapi_extra=INFER_REQUEST_BODY,
    responses=ERROR_RESPONSES,
)
async def infer(request: Request, name: str) -> Response:
    return await _routed_infer(request, name, None)


@router.post(
    "/models/{name}/versions/{version}/infer",
    response_model=InferResponse,
    summary="Inference on a model version",
    openapi_extra=INFER_REQUEST_BODY,
    responses=ERROR_RESPONSES,
)
async def infer_version(request: Request, name: str, version: str) -> Response:
    return await _routed_infer(request, name, version)
