"""nograd's own placement route: what this replica holds, for a balancer or an operator
(``nograd.serving.placement``); Triton's repository index stays as Triton answers it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from nograd.http.state import placement_of
from nograd.protocol.v2 import dumps

router = APIRouter(prefix="/nograd", tags=["Placement"])


@router.get(
    "/placement",
    summary="Each model of the repository resident, loading or not, with the bytes it holds, "
    "its queue and requests in flight; the memory limit, used and free bytes",
    response_model=dict[str, Any],
)
async def placement(request: Request) -> Response:
    document = await placement_of(request).document()
    return Response(content=dumps(document), media_type="application/json")
