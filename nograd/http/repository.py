"""Triton's model configuration and model repository routes: what Triton's clients and tools
(tritonclient, perf_analyzer) ask a server before they send inferences."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request, Response

from nograd.http.errors import error_body
from nograd.http.state import dataplane_of
from nograd.protocol.v2 import dumps
from nograd.protocol.v2_schemas import ERROR_RESPONSES, ErrorResponse, RepositoryIndexEntry
from nograd.serving.triton_config import model_configuration, repository_index

router = APIRouter(prefix="/v2", tags=["Model repository"])

MODEL_CONTROL_OFF = (
    "model control is not enabled on this server: every model in NOGRAD_MODEL_REPOSITORY "
    "loads at start-up, and a restart applies changes"
)
CONTROL_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Model control is not enabled"},
}


def _json(document: Any, status: int = 200) -> Response:
    return Response(content=dumps(document), status_code=status, media_type="application/json")


def _error(message: str, status: int = 400) -> Response:
    return Response(error_body(message), status, media_type="application/json")


def _configuration(request: Request, name: str, version: str | None) -> Response:
    plane = dataplane_of(request)
    return _json(model_configuration(plane.get(name, version), plane.settings))


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
    plane = dataplane_of(request)
    return _json(repository_index(list(plane.models.values()), ready_only=ready_only))


def _control_off(request: Request, name: str) -> Response:
    dataplane_of(request).get(name)  # an unknown model is still a 404
    return _error(MODEL_CONTROL_OFF)


@router.post(
    "/repository/models/{name}/load",
    summary="Load a model (needs model control)",
    responses={**CONTROL_RESPONSES, 404: ERROR_RESPONSES[404]},
)
async def load(request: Request, name: str) -> Response:
    return _control_off(request, name)


@router.post(
    "/repository/models/{name}/unload",
    summary="Unload a model (needs model control)",
    responses={**CONTROL_RESPONSES, 404: ERROR_RESPONSES[404]},
)
async def unload(request: Request, name: str) -> Response:
    return _control_off(request, name)
