"""TorchServe's inference and management API on nograd's port: ``/ping``, ``/predictions``,
``/models``; thin: decode the request into a handler's dict, call the serving core, encode the
handler's answer or a failure in TorchServe's error body."""

from __future__ import annotations

import json
from typing import Any, Final

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from nograd.core.handler_messages import HandlerAnswer
from nograd.formats.torchserve.api.documents import (
    DescribeDefaults,
    archive_of,
    model_description,
    model_list,
)
from nograd.formats.torchserve.api.management import Answer, ManagementError
from nograd.http.exchange import Incoming, run_call
from nograd.http.reply import Reply
from nograd.http.state import calls_of, dataplane_of, torchserve_of
from nograd.protocol.torchserve import error_body as ts_error_body
from nograd.protocol.torchserve import handler_request
from nograd.serving.calls.lifecycle import Call, Calls
from nograd.serving.errors import ModelNotFound
from nograd.serving.registry import ServedModel


class TorchServeError(BaseModel):
    """TorchServe's error body."""

    code: int
    type: str
    message: str


ANSWERS: Final[dict[int | str, dict[str, Any]]] = {
    "default": {
        "model": TorchServeError,
        "description": "TorchServe's status and error body: the model's handler may set any "
        "status (PredictionException), as in TorchServe",
    }
}
"""The statuses of every TorchServe route, documented as TorchServe's frontend answers them."""

router = APIRouter(tags=["TorchServe"], responses=ANSWERS)
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


def _version_missing(model: ServedModel, name: str, version: str | None) -> Reply | None:
    """TorchServe's 404 for a version the archive does not have (it serves as nograd's 1)."""
    archive = archive_of(model)
    own = archive.version if archive is not None else model.version
    if version is None or version == own:
        return None
    message = f"Model version: {version} does not exist for model: {name}"
    return Reply(404, ts_error_body(404, "ModelVersionNotFoundException", message))


async def predictions_call(
    incoming: Incoming, calls: Calls, name: str, version: str | None
) -> Reply:
    """One TorchServe prediction: the body (raw, JSON, text or a form) as the handler's dict;
    the query string is not read, as TorchServe's ``/predictions`` does not."""

    async def work(call: Call) -> Reply:
        call.model = calls.label(name)
        try:
            await calls.resident(call, name)
            model = calls.served(call, name, None)
        except ModelNotFound:
            return _error(404, f"Model not found: {name}")
        missing = _version_missing(model, name, version)
        if missing is not None:
            return missing
        if archive_of(model) is None:
            return _error(400, f"Model {name} is not a TorchServe archive; use /v2/models/{name}")
        body = await incoming.body()
        answer = await calls.predict(call, name, handler_request(body, incoming.headers))
        if answer.failed:
            return _handler_failure(answer)
        return Reply(answer.status, answer.body, answer.content_type)

    return await run_call(incoming, calls, PROTOCOL, work, _error)


def _handler_failure(answer: HandlerAnswer) -> Reply:
    """A prediction the handler failed, as TorchServe's frontend sends it (``RestJob.sendError``):
    always an ``InternalServerException`` with the worker's status and message, 413 sent as 507."""
    status = 507 if answer.status == 413 else answer.status
    message = answer.body.decode("utf-8", "replace")
    return Reply(status, ts_error_body(status, "InternalServerException", message))


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
    except ModelNotFound:
        return _error(404, f"Model not found: {name}").response()
    missing = _version_missing(model, name, version)
    if missing is not None:
        return missing.response()
    defaults = DescribeDefaults(
        plane.settings.max_queue_delay_ms,
        plane.settings.max_queue_size,
        torchserve_of(request).started,
    )
    document = [model_description(model, defaults, torchserve_of(request).workers.get(name))]
    return Response(_dumps(document), media_type="application/json")


@router.get("/models/{name}", summary="TorchServe: describe a model")
async def describe_model(request: Request, name: str) -> Response:
    return _describe(request, name, None)


@router.get("/models/{name}/{version}", summary="TorchServe: describe a model version")
async def describe_version(request: Request, name: str, version: str) -> Response:
    return _describe(request, name, None if version == "all" else version)


def _answer(work: Answer | ManagementError) -> Response:
    """A management call's ``StatusResponse``, or its error in TorchServe's body."""
    if isinstance(work, ManagementError):
        body = ts_error_body(work.code, work.kind, work.message)
        return Response(body, status_code=work.code, media_type="application/json")
    return Response(
        _dumps({"status": work.status}), status_code=work.code, media_type="application/json"
    )


def _int(values: dict[str, Any], key: str, default: int) -> int:
    """An integer parameter read as TorchServe reads one: anything else is the default."""
    try:
        return int(str(values[key]))
    except (KeyError, ValueError):
        return default


def _flag(values: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean parameter read as Java's ``Boolean.parseBoolean``."""
    value = values.get(key)
    return default if value is None else str(value).lower() == "true"


async def _register_parameters(request: Request) -> dict[str, Any]:
    """The query's parameters, or a JSON body's fields (TorchServe takes either)."""
    values: dict[str, Any] = dict(request.query_params)
    if request.headers.get("content-type", "").split(";")[0].strip() == "application/json":
        try:
            document = json.loads(await request.body())
        except RecursionError as exc:
            raise ManagementError(
                400, "BadRequestException", "malformed JSON: nested too deeply"
            ) from exc
        except ValueError as exc:
            raise ManagementError(400, "BadRequestException", f"malformed JSON: {exc}") from exc
        if isinstance(document, dict):
            values.update(document)
    return values


@router.post("/models", summary="TorchServe: register an archive of the repository")
async def register_model(request: Request) -> Response:
    try:
        values = await _register_parameters(request)
        url = values.get("url")
        name = values.get("model_name")
        answer = await torchserve_of(request).register(
            None if url is None else str(url),
            None if name is None else str(name),
            _int(values, "initial_workers", 1),
            _flag(values, "synchronous", True),
        )
    except ManagementError as exc:
        return _answer(exc)
    return _answer(answer)


async def _scale(request: Request, name: str, version: str | None) -> Response:
    values = dict(request.query_params)
    low = _int(values, "min_worker", 1)
    try:
        answer = await torchserve_of(request).scale(
            name,
            version if version is not None else values.get("model_version"),
            low,
            _int(values, "max_worker", low),
            _flag(values, "synchronous", False),
        )
    except ManagementError as exc:
        return _answer(exc)
    return _answer(answer)


@router.put("/models/{name}", summary="TorchServe: scale a model's workers (recorded)")
async def scale_model(request: Request, name: str) -> Response:
    return await _scale(request, name, None)


@router.put("/models/{name}/{version}", summary="TorchServe: scale a model version's workers")
async def scale_version(request: Request, name: str, version: str) -> Response:
    return await _scale(request, name, version)


async def _unregister(request: Request, name: str, version: str | None) -> Response:
    try:
        return _answer(await torchserve_of(request).unregister(name, version))
    except ManagementError as exc:
        return _answer(exc)


@router.delete("/models/{name}", summary="TorchServe: unregister a model")
async def unregister_model(request: Request, name: str) -> Response:
    return await _unregister(request, name, None)


@router.delete("/models/{name}/{version}", summary="TorchServe: unregister a model version")
async def unregister_version(request: Request, name: str, version: str) -> Response:
    return await _unregister(request, name, version)
