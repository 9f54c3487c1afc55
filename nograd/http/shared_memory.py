"""Triton's shared-memory extension routes: register, unregister and status of system
shared-memory regions (``/v2/systemsharedmemory``) and of CUDA ones (``/v2/cudasharedmemory``:
a client's IPC handle, opened on a server that sees a GPU; elsewhere registering is refused as
Triton refuses it without GPU support, and status and unregister answer as it does). Each call
acts on its caller's regions only (the API key it carries)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from nograd.http.exchange import caller_of
from nograd.http.state import calls_of
from nograd.protocol.v2 import dumps, parse_json
from nograd.protocol.v2_schemas import ERROR_RESPONSES
from nograd.serving.errors import InvalidInput
from nograd.serving.extensions.cuda_shared_memory import KIND as CUDA
from nograd.serving.extensions.cuda_shared_memory import decode_handle
from nograd.serving.extensions.shared_memory import SharedMemory

router = APIRouter(prefix="/v2", tags=["Shared memory"])


def _regions(request: Request) -> SharedMemory:
    return calls_of(request).shared_memory


def _caller(request: Request) -> str:
    """The caller whose regions the call acts on."""
    return caller_of(calls_of(request), request.scope)


def _json(document: Any) -> Response:
    return Response(content=dumps(document), media_type="application/json")


@router.get("/systemsharedmemory/status", summary="Every registered system shared-memory region")
async def system_status(request: Request) -> Response:
    return _json(_regions(request).status(None, caller=_caller(request)))


@router.get(
    "/systemsharedmemory/region/{name}/status",
    summary="One system shared-memory region",
    responses=ERROR_RESPONSES,
)
async def system_region_status(request: Request, name: str) -> Response:
    return _json(_regions(request).status(name, caller=_caller(request)))


@router.post(
    "/systemsharedmemory/region/{name}/register",
    response_class=Response,
    summary="Register a system shared-memory region: JSON {key, offset, byte_size}",
    responses=ERROR_RESPONSES,
)
async def system_register(request: Request, name: str) -> Response:
    _regions(request).check_served()
    document = parse_json(await request.body())
    if not isinstance(document, dict) or "key" not in document or "byte_size" not in document:
        raise InvalidInput(
            f"failed to register shared memory region '{name}': the body must be a JSON object "
            "with 'key', 'byte_size' and optionally 'offset'"
        )
    offset = document.get("offset", 0)
    caller = _caller(request)
    await _regions(request).register(name, document["key"], offset, document["byte_size"], caller)
    return Response(status_code=200)


@router.post(
    "/systemsharedmemory/region/{name}/unregister",
    response_class=Response,
    summary="Unregister a system shared-memory region",
    responses=ERROR_RESPONSES,
)
async def system_unregister(request: Request, name: str) -> Response:
    await _regions(request).unregister(name, caller=_caller(request))
    return Response(status_code=200)


@router.post(
    "/systemsharedmemory/unregister",
    response_class=Response,
    summary="Unregister every system region",
    responses=ERROR_RESPONSES,
)
async def system_unregister_all(request: Request) -> Response:
    await _regions(request).unregister(None, caller=_caller(request))
    return Response(status_code=200)


@router.get("/cudasharedmemory/status", summary="Every registered CUDA shared-memory region")
async def cuda_status(request: Request) -> Response:
    return _json(_regions(request).status(None, CUDA, _caller(request)))


@router.get(
    "/cudasharedmemory/region/{name}/status",
    summary="One CUDA shared-memory region",
    responses=ERROR_RESPONSES,
)
async def cuda_region_status(request: Request, name: str) -> Response:
    return _json(_regions(request).status(name, CUDA, _caller(request)))


@router.post(
    "/cudasharedmemory/region/{name}/register",
    response_class=Response,
    summary="Register a CUDA shared-memory region: JSON {raw_handle: {b64}, device_id, byte_size}",
    responses=ERROR_RESPONSES,
)
async def cuda_register(request: Request, name: str) -> Response:
    regions = _regions(request)
    await regions.require_cuda(name)  # without a GPU, Triton's refusal whatever the body holds
    document = parse_json(await request.body())
    if not isinstance(document, dict) or "raw_handle" not in document:
        raise InvalidInput("Shared memory register request has no 'raw_handle' field")
    raw_handle = document["raw_handle"]
    if not isinstance(raw_handle, dict) or "b64" not in raw_handle:
        raise InvalidInput("'raw_handle' must be a JSON object {\"b64\": <base64 handle>}")
    if "byte_size" not in document or "device_id" not in document:
        raise InvalidInput(
            f"failed to register CUDA shared memory region '{name}': the body must give "
            "'raw_handle', 'device_id' and 'byte_size'"
        )
    handle = decode_handle(name, raw_handle["b64"])
    device_id, byte_size = document["device_id"], document["byte_size"]
    await regions.register_cuda(name, handle, device_id, byte_size, _caller(request))
    return Response(status_code=200)


@router.post(
    "/cudasharedmemory/region/{name}/unregister",
    response_class=Response,
    summary="Unregister a CUDA shared-memory region",
    responses=ERROR_RESPONSES,
)
async def cuda_unregister(request: Request, name: str) -> Response:
    await _regions(request).unregister(name, CUDA, _caller(request))
    return Response(status_code=200)


@router.post(
    "/cudasharedmemory/unregister",
    response_class=Response,
    summary="Unregister every CUDA region",
    responses=ERROR_RESPONSES,
)
async def cuda_unregister_all(request: Request) -> Response:
    await _regions(request).unregister(None, CUDA, _caller(request))
    return Response(status_code=200)
