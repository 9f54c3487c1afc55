"""Triton's trace and logging extensions for every front: the trace setting (global or one
model's) and the log settings, read and changed while the server runs, alike in every worker.

A change is checked, applied here, then passed to the sibling workers
(``nograd.serving.control.peers``) so that whichever worker a later request lands on traces and logs
the same way. Traces go to Triton's trace file or, in the ``opentelemetry`` mode, to an OTLP
collector.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Final

from nograd.observability.log_settings import LogSettings
from nograd.observability.logs import resolve_format
from nograd.observability.trace_file import TraceFile
from nograd.observability.trace_settings import (
    BadSetting,
    FixedSetting,
    TraceSetting,
    TraceSettings,
    Value,
    document,
)
from nograd.observability.tracing import Tracer, TraceSink
from nograd.serving.control.peers import Peers
from nograd.serving.dataplane import DataPlane
from nograd.serving.errors import (
    InvalidInput,
    LoadFailed,
    ModelNotFound,
    Unsupported,
)
from nograd.settings import Settings

PEER_OP: Final = "diagnostics"


def initial_setting(settings: Settings) -> TraceSetting:
    return TraceSetting(
        level=settings.trace_level,
        rate=settings.trace_rate,
        count=settings.trace_count,
        log_frequency=settings.trace_log_frequency,
    )


def trace_sink(settings: Settings) -> TraceSink:
    """Where sampled traces go. Several workers each write a file of their own (``.w<pid>``);
    one process, or one engine beside its fronts, writes Triton's file name itself."""
    if settings.trace_mode == "opentelemetry":
        # OpenTelemetry's SDK and exporter are imported only by a server that sends spans.
        from nograd.observability.otlp import OtlpSpans

        return OtlpSpans(
            settings.otlp_endpoint,
            settings.server_name,
            settings.otlp_export_delay_ms,
            max_queue_size=settings.otlp_max_queue_size,
            timeout_s=settings.otlp_timeout_s,
        )
    path = settings.trace_file
    if path is not None and settings.worker_count > 1:
        path = path.with_name(f"{path.name}.w{os.getpid()}")
    return TraceFile(path, settings.trace_file_max_bytes, settings.trace_max_files)


class Diagnostics:
    """The trace and log settings of this worker, kept alike in its siblings."""

    def __init__(self, settings: Settings, plane: DataPlane, peers: Peers | None) -> None:
        self._settings = settings
        self._plane = plane
        self._peers = peers
        self.tracer = Tracer(TraceSettings(initial_setting(settings)), trace_sink(settings))
        self.logs = LogSettings(resolve_format(settings.log_format))
        if peers is not None:
            peers.routes[PEER_OP] = self._from_peer

    # ------------------------------------------------------------------ trace extension
    def trace_setting(self, model: str | None) -> dict[str, object]:
        """The trace setting of ``model`` (None: the global one), as Triton answers it."""
        self._check_model(model)
        settings = self._settings
        trace_file = "" if settings.trace_file is None else str(settings.trace_file)
        setting = self.tracer.setting(model)
        return document(setting, settings.trace_mode, trace_file, settings.otlp_endpoint)

    async def update_trace_setting(
        self, model: str | None, changes: Mapping[str, Value]
    ) -> dict[str, object]:
        """Change the trace setting of ``model`` (None: the global one); the new setting."""
        self._check_model(model)
        _checked(lambda: self.tracer.update(model, changes))
        await self._tell_siblings({"what": "trace", "model": model, "changes": dict(changes)})
        return self.trace_setting(model)

    def _check_model(self, model: str | None) -> None:
        """Triton's: a model's trace setting needs the model served and ready."""
        if model is None:
            return
        try:
            ready = self._plane.get(model).ready
        except ModelNotFound:
            ready = False
        if not ready:
            raise InvalidInput(f"Request for unknown model : {model}")

    # ------------------------------------------------------------------ logging extension
    def log_settings(self) -> dict[str, object]:
        return self.logs.document()

    async def update_log_settings(self, changes: Mapping[str, object]) -> dict[str, object]:
        _checked(lambda: self.logs.update(changes))
        await self._tell_siblings({"what": "logging", "changes": dict(changes)})
        return self.logs.document()

    # ------------------------------------------------------------------ workers
    async def _tell_siblings(self, call: dict[str, Any]) -> None:
        if self._peers is None:
            return
        async with self._peers.exclusive():
            failures = await self._peers.broadcast({"op": PEER_OP} | call)
        if failures:
            detail = "; ".join(f"{w}: {error}" for w, error in sorted(failures.items()))
            raise LoadFailed(f"setting applied in this worker only: {detail}")

    async def _from_peer(self, call: dict[str, Any]) -> str | None:
        try:
            if call.get("what") == "trace":
                model = call.get("model")
                self.tracer.update(None if model is None else str(model), call["changes"])
            else:
                self.logs.update(call["changes"])
        except BadSetting as exc:
            return str(exc)
        return None

    def close(self) -> None:
        """Write or send the traces still held (the server stops)."""
        self.tracer.close()


def _checked(change: Callable[[], None]) -> None:
    """Run ``change``, a refused setting raised as the serving core's refusal."""
    try:
        change()
    except FixedSetting as exc:
        raise Unsupported(str(exc)) from None
    except BadSetting as exc:
        raise InvalidInput(str(exc)) from None
