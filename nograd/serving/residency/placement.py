"""What this replica holds, for a balancer or an operator deciding where a model's requests go
(``GET /nograd/placement``): each model of the repository resident, loading or not, the bytes it
holds against the memory limit, its queue and the requests holding it; and the limit, what the
resident models hold of it and the room left.

Triton's repository index answers name, version, state and reason, and nothing more; nograd does
not add fields to Triton's answers, so this view has a route of its own. It is bounded by the
repository (one row per model) and holds nothing per client. With several workers each keeps a
resident set of its own within its part of the limit: the worker that takes the call asks its
siblings for theirs and adds them up, as ``/metrics`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from nograd.serving.control.model_control import ModelControl
from nograd.serving.control.peers import Peers
from nograd.serving.registry import ModelRegistry, ServedModel, State
from nograd.serving.residency.on_demand import OnDemand
from nograd.serving.residency.policy import Residency

RESIDENT: Final = "resident"
LOADING: Final = "loading"
NOT_RESIDENT: Final = "not_resident"
PEER_OP: Final = "placement"
SIBLING_WAIT_S: Final = 5.0
"""How long the worker answering waits for each sibling's view; one that has not answered by
then (stopping, or its event loop stalled) is left out and the answer says so."""


@dataclass(frozen=True)
class ModelPlacement:
    """One model of the repository on this replica."""

    name: str
    state: str
    """``resident`` (it answers from memory), ``loading``, or ``not_resident`` (a request for it
    waits for a load, under on-demand control, or is refused until a load call)."""
    bytes: int
    """What it holds against the memory limit while resident: its measured weights, engine
    sessions and smallest batch (its weights outside on-demand control); 0 when not resident."""
    queue_depth: int
    """Requests waiting in its batch queues."""
    in_flight: int
    """Requests holding it now: waiting for its load, queued, running or being answered."""
    pinned: bool
    """Always resident (loaded at start-up), never evicted."""


def model_placements(
    names: Iterable[str],
    registry: ModelRegistry,
    residency: Residency | None,
    loading: Iterable[str] = (),
    pinned: Iterable[str] = (),
) -> list[ModelPlacement]:
    """A row per model of ``names`` (the repository's) and per model served, sorted by name.
    Under on-demand control ``residency`` says what is resident and what it holds; without it,
    a model with a ready version is resident and holds its versions' measured bytes."""
    loads, always = set(loading), set(pinned)
    rows = []
    for name in sorted(set(names) | set(registry.versions)):
        versions = registry.versions.get(name, {})
        resident, held, holds = _residence(name, versions, residency)
        loads_now = name in loads or any(v.state is State.LOADING for v in versions.values())
        state = RESIDENT if resident else LOADING if loads_now else NOT_RESIDENT
        queued = sum(v.batcher.queue_depth for v in versions.values() if v.batcher is not None)
        rows.append(ModelPlacement(name, state, held, queued, holds, name in always))
    return rows


def _residence(
    name: str, versions: Mapping[str, ServedModel], residency: Residency | None
) -> tuple[bool, int, int]:
    """(resident, bytes held, requests holding it) of ``name``."""
    active = sum(v.active for v in versions.values())
    if residency is not None:
        entry = residency.resident.get(name)
        held = 0 if entry is None else entry.bytes
        return entry is not None, held, max(active, residency.holds.get(name, 0))
    ready = [v for v in versions.values() if v.ready]
    held = sum(v.resident_bytes or v.weights_bytes for v in ready)
    return bool(ready), held, active


def placement_document(
    rows: Iterable[ModelPlacement], limit: int | None, model_control: str, workers: int
) -> dict[str, Any]:
    """One worker's view, as ``GET /nograd/placement`` answers it: its memory limit (None
    without one: only on-demand control keeps models within a limit), what the resident models
    hold of it and what is free, and each model's row."""
    models = list(rows)
    used = sum(row.bytes for row in models if row.state == RESIDENT)
    return {
        "model_control": model_control,
        "workers": workers,
        "workers_answered": 1,
        "memory": {
            "limit_bytes": limit,
            "used_bytes": used,
            "free_bytes": None if limit is None else max(0, limit - used),
        },
        "models": [
            {
                "name": row.name,
                "state": row.state,
                "bytes": row.bytes,
                "queue_depth": row.queue_depth,
                "in_flight": row.in_flight,
                "pinned": row.pinned,
                "resident_workers": int(row.state == RESIDENT),
            }
            for row in models
        ],
    }


def combined(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole server's view from each worker's (``placement_document``): limits, bytes,
    queues and requests added up; a model is resident where any worker holds it (counted in
    ``resident_workers``), else loading where any loads it."""
    first, *others = documents
    if not others:
        return first
    memory = {
        key: None if first["memory"][key] is None else sum(d["memory"][key] for d in documents)
        for key in first["memory"]
    }
    rows: dict[str, dict[str, Any]] = {}
    for document in documents:
        for row in document["models"]:
            seen = rows.get(row["name"])
            if seen is None:
                rows[row["name"]] = dict(row)
                continue
            for key in ("bytes", "queue_depth", "in_flight", "resident_workers"):
                seen[key] += row[key]
            seen["pinned"] = seen["pinned"] or row["pinned"]
            states = {seen["state"], row["state"]}
            seen["state"] = next(s for s in (RESIDENT, LOADING, NOT_RESIDENT) if s in states)
    return {
        **first,
        "workers_answered": sum(d["workers_answered"] for d in documents),
        "memory": memory,
        "models": [rows[name] for name in sorted(rows)],
    }


class Placement:
    """The placement view of the server, read when a balancer or an operator asks: this
    worker's, with its siblings' added (``peers``: None in a server of one process)."""

    def __init__(
        self,
        control: ModelControl,
        registry: ModelRegistry,
        on_demand: OnDemand | None,
        workers: int,
        peers: Peers | None = None,
    ) -> None:
        self._control = control
        self._registry = registry
        self._on_demand = on_demand
        self._workers = workers
        self._peers = peers
        if peers is not None:
            peers.answers[PEER_OP] = lambda _: self.worker_document()

    async def document(self) -> dict[str, Any]:
        own = self.worker_document()
        if self._peers is None:
            return own
        return combined([own, *await self._peers.gather({"op": PEER_OP}, SIBLING_WAIT_S)])

    def worker_document(self) -> dict[str, Any]:
        names = self._control.repository_names()
        pinned = self._control.pinned
        mode = self._control.mode
        if self._on_demand is None:
            rows = model_placements(names, self._registry, None, pinned=pinned)
            return placement_document(rows, None, mode, self._workers)
        residency = self._on_demand.residency
        rows = model_placements(names, self._registry, residency, self._on_demand.loading, pinned)
        return placement_document(rows, residency.limit, mode, self._workers)
