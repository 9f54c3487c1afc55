"""nograd's own placement route: what this replica holds, for a balancer or an operator
(``nograd.serving.residency.placement``); Triton's repository index stays as Triton answers it."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from nograd.http.state import placement_of
from nograd.protocol.v2 import dumps

router = APIRouter(prefix="/nograd", tags=["Placement"])


class PlacementMemory(BaseModel):
    limit_bytes: int | None
    """The memory limit resident models are kept within (None: not on-demand control)."""
    used_bytes: int
    free_bytes: int | None


class ModelPlacementRow(BaseModel):
    name: str
    state: Literal["resident", "loading", "not_resident"]
    bytes: int
    queue_depth: int
    in_flight: int
    pinned: bool
    resident_workers: int


class PlacementAnswer(BaseModel):
    model_control: str
    workers: int
    workers_answered: int
    memory: PlacementMemory
    models: list[ModelPlacementRow]


@router.get(
    "/placement",
    summary="Each model of the repository resident, loading or not, with the bytes it holds, "
    "its queue and requests in flight; the memory limit, used and free bytes (all workers)",
    response_model=PlacementAnswer,
)
async def placement(request: Request) -> Response:
    document = await placement_of(request).document()
    return Response(content=dumps(document), media_type="application/json")
