"""Triton's model configuration and model repository routes: what Triton's clients and tools
(tritonclient, perf_analyzer) ask a server before they send inferences."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request, Response

from nograd.formats.triton.api.documents import model_configuration, repository_index
from nograd.http.error_bodies import error_body
from nograd.http.state import calls_of, control_of, dataplane_of
from nograd.protocol.v2 import dumps
from nograd.protocol.v2_schemas import ERROR_RESPONSES, ErrorResponse, RepositoryIndexEntry
from nograd.serving.control.control_calls import load_model, unload_parameters
from nograd.serving.errors import InvalidInput

router = APIRouter(prefix="/v2", tags=["Model repository"])

CONTROL_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {
        "model": ErrorResponse,
        "description": "Model control is not enabled, the override is invalid, or a version "
        "failed to load (the versions serving before still serve)",
    },
}


def _json(document: Any, status: int = 200) -> Response:
    return Response(content=dumps(document), status_code=status, media_type="application/json")


def _error(message: str, status: int = 400) -> Response:
    return Response(error_body(message), status, media_type="application/json")


def _configuration(request: Request, name: str, version: str | None) -> Response:
    model = calls_of(request).described(name, version)
    return _json(model_configuration(model, dataplane_of(request).settings))


@router.get(
    "/models/{name}/config",
    summary="Model configuration (Triton's model configuration extension)",
    response_model=dict[str, Any],
    responses=ERROR_RESPONSES,
)
async def model_config(request: Request, name: str) -> Response:
    return _configuration(request, name, None)


@router.get(
    "/models/{name}/versions/{version}/config",
    summary="Model version configuration",
    response_model=dict[str, Any],
    responses=ERROR_RESPONSES,
)
async def model_version_config(request: Request, name: str, version: str) -> Response:
    return _configuration(request, name, version)


@router.post(
    "/repository/index",
    summary='Every model of the repository with its state; body {"ready": true} for the ready',
    response_model=list[RepositoryIndexEntry],
    responses={400: ERROR_RESPONSES[400]},
    openapi_extra={
        "requestBody": {
            "required": False,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "properties": {"ready": {"type": "boolean"}},
                    }
                }
            },
        }
    },
)
async def index(request: Request) -> Response:
    body = await request.body()
    ready_only = False
    if body.strip():
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            return _error(f"malformed JSON body: {exc}")
        if not isinstance(document, dict):
            return _error('the body must be a JSON object such as {"ready": true}')
        ready = document.get("ready", False)
        if not isinstance(ready, bool):
            return _error(f"'ready' must be true or false, got {ready!r}")
        ready_only = ready
    return _json(repository_index(control_of(request).index(), ready_only=ready_only))


async def _parameters(request: Request, example: str) -> dict[str, Any]:
    """A repository call's ``parameters`` object (empty without a body)."""
    body = await request.body()
    if not body.strip():
        return {}
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"malformed JSON body: {exc}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("parameters", {}), dict):
        raise InvalidInput(f"the body must be a JSON object such as {example}")
    parameters: dict[str, Any] = document.get("parameters", {})
    return parameters


@router.post(
    "/repository/models/{name}/load",
    summary="Load a model, or reload what changed of it (NOGRAD_MODEL_CONTROL=explicit); "
    'body {"parameters": {"config": "<JSON of config fields>"}} overrides its config',
    responses={**CONTROL_RESPONSES, 404: ERROR_RESPONSES[404]},
)
async def load(request: Request, name: str) -> Response:
    parameters = await _parameters(request, '{"parameters": {"config": "{...}"}}')
    await load_model(control_of(request), name, parameters)
    return Response(status_code=200)


@router.post(
    "/repository/models/{name}/unload",
    summary="Unload every version of a model once its accepted requests are answered "
    "(NOGRAD_MODEL_CONTROL=explicit)",
    responses={**CONTROL_RESPONSES, 404: ERROR_RESPONSES[404]},
)
async def unload(request: Request, name: str) -> Response:
    parameters = await _parameters(request, '{"parameters": {"unload_dependents": true}}')
    await control_of(request).unload(name, unload_parameters(parameters))
    return Response(status_code=200)
