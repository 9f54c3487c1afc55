"""Triton's shared-memory extension routes: register, unregister and status of system
shared-memory regions (``/v2/systemsharedmemory``), and the CUDA ones answered as Triton answers
them on a server without a GPU (nothing registered; registering refused)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from nograd.http.state import calls_of
from nograd.protocol.v2 import dumps, parse_json
from nograd.protocol.v2_schemas import ERROR_RESPONSES
from nograd.serving.errors import InvalidInput, RegionNotFound
from nograd.serving.shared_memory import SharedMemory, cuda_refusal

router = APIRouter(prefix="/v2", tags=["Shared memory"])


def _regions(request: Request) -> SharedMemory:
    return calls_of(request).shared_memory


def _json(document: Any) -> Response:
    return Response(content=dumps(document), media_type="application/json")


@router.get("/systemsharedmemory/status", summary="Every registered system shared-memory region")
async def system_status(request: Request) -> Response:
    return _json(_regions(request).status())


@router.get(
    "/systemsharedmemory/region/{name}/status",
    summary="One system shared-memory region",
    responses=ERROR_RESPONSES,
)
async def system_region_status(request: Request, name: str) -> Response:
    return _json(_regions(request).status(name))


@router.post(
    "/systemsharedmemory/region/{name}/register",
    response_class=Response,
    summary="Register a system shared-memory region: JSON {key, offset, byte_size}",
    responses=ERROR_RESPONSES,
)
async def system_register(request: Request, name: str) -> Response:
    document = parse_json(await request.body())
    if not isinstance(document, dict) or "key" not in document or "byte_size" not in document:
        raise InvalidInput(
            f"failed to register shared memory region '{name}': the body must be a JSON object "
            "with 'key', 'byte_size' and optionally 'offset'"
        )
    offset = document.get("offset", 0)
    await _regions(request).register(name, document["key"], offset, document["byte_size"])
    return Response(status_code=200)


@router.post(
    "/systemsharedmemory/region/{name}/unregister",
    response_class=Response,
    summary="Unregister a system shared-memory region",
    responses=ERROR_RESPONSES,
)
async def system_unregister(request: Request, name: str) -> Response:
    await _regions(request).unregister(name)
    return Response(status_code=200)


@router.post(
    "/systemsharedmemory/unregister",
    response_class=Response,
    summary="Unregister every system region",
    responses=ERROR_RESPONSES,
)
async def system_unregister_all(request: Request) -> Response:
    await _regions(request).unregister(None)
    return Response(status_code=200)


@router.get("/cudasharedmemory/status", summary="CUDA shared-memory regions: none")
async def cuda_status() -> Response:
    return _json([])


@router.get("/cudasharedmemory/region/{name}/status", responses=ERROR_RESPONSES)
async def cuda_region_status(name: str) -> Response:
    raise RegionNotFound(f"Unable to find cuda shared memory region: '{name}'")


@router.post(
    "/cudasharedmemory/region/{name}/register", response_class=Response, responses=ERROR_RESPONSES
)
async def cuda_register(name: str) -> Response:
    raise InvalidInput(cuda_refusal(name))


@router.post("/cudasharedmemory/region/{name}/unregister", response_class=Response)
async def cuda_unregister(name: str) -> Response:
    return Response(status_code=200)


@router.post("/cudasharedmemory/unregister", response_class=Response)
async def cuda_unregister_all() -> Response:
    return Response(status_code=200)
