"""Triton's trace and logging extension routes: ``/v2/trace/setting`` (global or one model's)
and ``/v2/logging``, read with GET and changed with POST, answered as Triton answers them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from nograd.http.state import diagnostics_of
from nograd.protocol.v2 import dumps, parse_json
from nograd.protocol.v2_schemas import ERROR_RESPONSES
from nograd.serving.errors import InvalidInput

router = APIRouter(prefix="/v2", tags=["Trace and logging"])


def _json(document: Any) -> Response:
    return Response(content=dumps(document), media_type="application/json")


async def _changes(request: Request, what: str) -> dict[str, Any]:
    """The POSTed settings: a JSON object (an empty body changes nothing, as in Triton)."""
    body = await request.body()
    document = parse_json(body) if body.strip() else {}
    if not isinstance(document, dict):
        raise InvalidInput(f"the {what} request must be a JSON object of settings")
    return document


@router.get("/trace/setting", summary="The global trace setting", responses=ERROR_RESPONSES)
async def trace_setting(request: Request) -> Response:
    return _json(diagnostics_of(request).trace_setting(None))


@router.post("/trace/setting", summary="Change the global trace setting", responses=ERROR_RESPONSES)
async def update_trace_setting(request: Request) -> Response:
    changes = await _changes(request, "trace")
    return _json(await diagnostics_of(request).update_trace_setting(None, changes))


@router.get(
    "/models/{model}/trace/setting", summary="A model's trace setting", responses=ERROR_RESPONSES
)
async def model_trace_setting(request: Request, model: str) -> Response:
    return _json(diagnostics_of(request).trace_setting(model))


@router.post(
    "/models/{model}/trace/setting",
    summary="Change a model's trace setting (null: follow the global one)",
    responses=ERROR_RESPONSES,
)
async def update_model_trace_setting(request: Request, model: str) -> Response:
    changes = await _changes(request, "trace")
    return _json(await diagnostics_of(request).update_trace_setting(model, changes))


@router.get("/logging", summary="The log settings", responses=ERROR_RESPONSES)
async def log_settings(request: Request) -> Response:
    return _json(diagnostics_of(request).log_settings())


@router.post("/logging", summary="Change the log settings", responses=ERROR_RESPONSES)
async def update_log_settings(request: Request) -> Response:
    changes = await _changes(request, "dynamic logging")
    return _json(await diagnostics_of(request).update_log_settings(changes))
