"""Request traces (Triton's trace extension): which inference requests are sampled, under the
trace setting in force for their model, and the timestamps each sampled one records.

A sampled request carries its ``Trace`` in a context variable while the serving core handles it,
so the steps that stamp it (queued, computed) need no parameter threaded through them. With
tracing off for every model, ``Tracer.active`` is False and a request costs one attribute read.
Timestamps are ``time.perf_counter_ns`` (the monotonic clock, as Triton's are); a sink that
needs wall time converts them with ``epoch_offset_ns``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import replace
from typing import Protocol

from nograd.observability.trace_settings import TraceSetting, TraceSettings, Value

ACTIVE: ContextVar[Trace | None] = ContextVar("nograd_trace", default=None)
"""The trace of the request the current task serves, when it is sampled."""
_IDS = itertools.count(1)
"""Trace ids, one sequence for every trace and child trace of the process (0: no parent)."""


def epoch_offset_ns() -> int:
    """What to add to a ``perf_counter_ns`` reading for nanoseconds since the epoch."""
    return time.time_ns() - time.perf_counter_ns()


class Trace:
    """One sampled request: who it is, and its timestamps by Triton's names, in order taken."""

    __slots__ = (
        "children",
        "id",
        "model",
        "parent",
        "parent_id",
        "request_id",
        "stamps",
        "token",
        "version",
    )

    def __init__(
        self, trace_id: int, model: str, request_id: str, parent: str | None, parent_id: int = 0
    ) -> None:
        self.id = trace_id
        self.model = model
        self.version = ""
        self.request_id = request_id
        self.parent = parent
        """The caller's W3C ``traceparent``, if it sent one."""
        self.parent_id = parent_id
        """The id of the ensemble's trace this step's trace belongs to (0: none)."""
        self.children: list[Trace] = []
        """The traces of an ensemble's steps, in the order they started."""
        self.stamps: dict[str, int] = {}
        self.token: Token[Trace | None] | None = None

    def stamp(self, name: str, ns: int | None = None, *, first: bool = False) -> None:
        """Record ``name`` now (or at ``ns``); with ``first`` an earlier stamp of it is kept
        (a request cut in chunks, or an ensemble's steps, computes more than once)."""
        if first and name in self.stamps:
            return
        self.stamps[name] = time.perf_counter_ns() if ns is None else ns

    def spawn(self, model: str) -> Trace:
        """A child trace for one of this ensemble's steps (Triton's ``SpawnChildTrace``), stamped
        REQUEST_START."""
        child = Trace(next(_IDS), model, self.request_id, None, parent_id=self.id)
        child.stamp("REQUEST_START")
        self.children.append(child)
        return child


@contextmanager
def step_trace(model: str) -> Iterator[None]:
    """Within an ensemble's sampled request, the step on ``model`` runs under a child trace of
    its own (the active one while it runs), stamped REQUEST_END when the step ends."""
    parent = ACTIVE.get()
    if parent is None:
        yield
        return
    child = parent.spawn(model)
    token = ACTIVE.set(child)
    try:
        yield
    finally:
        child.stamp("REQUEST_END")
        ACTIVE.reset(token)


class TraceSink(Protocol):
    """Where finished traces go: Triton's trace file, or OpenTelemetry spans."""

    def write(self, trace: Trace, log_frequency: int, exhausted: bool) -> None: ...

    def close(self) -> None: ...


class Tracer:
    """Samples requests by the trace settings and hands each finished trace to the sink."""

    def __init__(self, settings: TraceSettings, sink: TraceSink) -> None:
        self.settings = settings
        self._sink = sink
        self._seen: dict[str | None, int] = {}
        self._left: dict[str | None, int] = {}
        self.active = False
        self._refresh()

    def update(self, model: str | None, changes: Mapping[str, Value]) -> None:
        """Change a setting (``BadSetting`` when refused); its sampling starts over, as in
        Triton, where each update makes a new setting."""
        self.settings.update(model, changes)
        self._refresh()

    def _refresh(self) -> None:
        self._seen.clear()
        self._left.clear()
        settings = self.settings
        self.active = settings.global_setting.on or any(s.on for s in settings.models.values())

    def setting(self, model: str | None) -> TraceSetting:
        """The setting in force for ``model``, its count being what is left to sample."""
        key = model if model in self.settings.models else None
        setting = self.settings.of(key)
        return replace(setting, count=self._left.get(key, setting.count))

    def begin(self, model: str, request_id: str, parent: str | None) -> Trace | None:
        """Sample one request for ``model``: every ``trace_rate``-th request under its setting,
        while ``trace_count`` (-1: no limit) lasts. A sampled one is stamped REQUEST_START and
        made the task's active trace."""
        key = model if model in self.settings.models else None
        setting = self.settings.of(key)
        if not setting.on or setting.rate == 0:
            return None
        left = self._left.get(key, setting.count)
        if left == 0:
            return None
        seen = self._seen.get(key, 0) + 1
        self._seen[key] = seen
        if seen % setting.rate:
            return None
        if left > 0:
            self._left[key] = left - 1
        trace = Trace(next(_IDS), model, request_id, parent)
        trace.stamp("REQUEST_START")
        trace.token = ACTIVE.set(trace)
        return trace

    def end(self, trace: Trace) -> None:
        """The request is answered (or failed): stamp REQUEST_END and hand the trace over."""
        trace.stamp("REQUEST_END")
        if trace.token is not None:
            ACTIVE.reset(trace.token)
            trace.token = None
        key = trace.model if trace.model in self.settings.models else None
        setting = self.settings.of(key)
        self._sink.write(trace, setting.log_frequency, exhausted=self._left.get(key) == 0)

    def close(self) -> None:
        """Write or send what is still held (the server stops)."""
        self._sink.close()
