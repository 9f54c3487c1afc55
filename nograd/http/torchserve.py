"""TorchServe's inference and management API on nograd's port: ``/ping``, ``/predictions``,
``/models``; thin: decode the request into a handler's dict, call the serving core, encode the
handler's answer or a failure in TorchServe's error body."""

from __future__ import annotations

import json
from typing import Any, Final
from urllib.parse import parse_qsl

import numpy as np
from fastapi import APIRouter, Request, Response

from nograd.core.handler_messages import RAW_FIELD, HandlerAnswer, HandlerRequest
from nograd.http.exchange import Incoming, Reply, run_call
from nograd.http.state import calls_of, dataplane_of
from nograd.protocol.torchserve import error_body as ts_error_body
from nograd.protocol.torchserve import request_data
from nograd.serving.calls import Call, Calls
from nograd.serving.errors import ModelNotFound
from nograd.serving.registry import ServedModel
from nograd.serving.torchserve_documents import archive_of, model_description, model_list

router = APIRouter(tags=["TorchServe"])
PROTOCOL: Final = "torchserve"
ERROR_TYPES: Final = {
    400: "BadRequestException",
    401: "InvalidKeyException",
    404: "ModelNotFoundException",
    413: "RequestEntityTooLargeException",
    503: "ServiceUnavailableException",
}


def _error(status: int, exc: Exception | str) -> Reply:
    kind = ERROR_TYPES.get(status, "InternalServerException")
    return Reply(status, ts_error_body(status, kind, str(exc)))


def _dumps(document: Any) -> bytes:
    return json.dumps(document, indent=2).encode()


def _versioned(model: ServedModel, name: str, version: str | None) -> None:
    """Refuse a TorchServe version the archive does not have (it serves as nograd's 1)."""
    archive = archive_of(model)
    own = archive.version if archive is not None else model.version
    if version is not None and version != own:
        raise ModelNotFound(f"Model version: {version} does not exist for model: {name}")


async def predictions_call(
    incoming: Incoming, calls: Calls, name: str, version: str | None
) -> Reply:
    """One TorchServe prediction: the body (raw, JSON, text or a form) as the handler's dict."""

    async def work(call: Call) -> Reply:
        call.model = calls.label(name)
        try:
            model = calls.plane.get(name)
        except ModelNotFound:
            return _error(404, f"Model not found: {name}")
        _versioned(model, name, version)
        if archive_of(model) is None:
            return _error(400, f"Model {name} is not a TorchServe archive; use /v2/models/{name}")
        body = await incoming.body()
        query = dict(_query(incoming))
        data = request_data(body, incoming.headers.get("content-type", ""), query)
        request = HandlerRequest(data, dict(incoming.headers))
        inputs = np.empty(1, dtype=np.object_)
        inputs[0] = request
        _, outputs = await calls.infer(call, name, None, {RAW_FIELD: inputs})
        answer: HandlerAnswer = outputs["answer"][0]
        if answer.status != 200 and answer.content_type is None:
            return _error(answer.status, answer.body.decode("utf-8", "replace"))
        return Reply(answer.status, answer.body, answer.content_type)

    return await run_call(incoming, calls, PROTOCOL, work, _error)


def _query(incoming: Incoming) -> list[tuple[str, str]]:
    raw: bytes = incoming.scope.get("query_string", b"")
    return parse_qsl(raw.decode("latin-1"), keep_blank_values=True)


async def _routed(request: Request, name: str, version: str | None) -> Response:
    incoming = Incoming(request.scope, request.receive)
    reply = await predictions_call(incoming, calls_of(request), name, version)
    return reply.response()


@router.get("/ping", summary="TorchServe health")
async def ping(request: Request) -> Response:
    healthy = dataplane_of(request).ready()
    status = 200 if healthy else 500
    return Response(
        _dumps({"status": "Healthy" if healthy else "Unhealthy"}),
        status_code=status,
        media_type="application/json",
    )


@router.api_route("/predictions/{name}", methods=["POST", "PUT"], summary="TorchServe predict")
async def predictions(request: Request, name: str) -> Response:
    return await _routed(request, name, None)


@router.api_route(
    "/predictions/{name}/{version}", methods=["POST", "PUT"], summary="TorchServe predict"
)
async def predictions_version(request: Request, name: str, version: str) -> Response:
    return await _routed(request, name, version)


@router.get("/models", summary="TorchServe: list models")
async def list_models(request: Request) -> Response:
    plane = dataplane_of(request)
    models = [plane.get(name) for name in plane.registry.versions]
    return Response(_dumps(model_list(models)), media_type="application/json")


def _describe(request: Request, name: str, version: str | None) -> Response:
    plane = dataplane_of(request)
    try:
        model = plane.get(name)
        _versioned(model, name, version)
    except ModelNotFound as exc:
        message = f"Model not found: {name}" if version is None else str(exc)
        return _error(404, message).response()
    document = [model_description(model, plane.settings.max_queue_delay_ms)]
    return Response(_dumps(document), media_type="application/json")


@router.get("/models/{name}", summary="TorchServe: describe a model")
async def describe_model(request: Request, name: str) -> Response:
    return _describe(request, name, None)


@router.get("/models/{name}/{version}", summary="TorchServe: describe a model version")
async def describe_version(request: Request, name: str, version: str) -> Response:
    return _describe(request, name, None if version == "all" else version)
