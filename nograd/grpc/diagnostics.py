"""The trace and logging extensions' RPCs of Triton's GRPCInferenceService (``TraceSetting``,
``LogSettings``), as tritonclient's ``get/update_trace_settings`` and
``get/update_log_settings`` call them; ``InferenceService`` takes them from here."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from google.protobuf.message import Message

from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.grpc.rpc import CallContext
from nograd.serving.core import Core
from nograd.serving.errors import InvalidInput

Reply = TypeVar("Reply", bound=Message)


def trace_parent(context: CallContext) -> str | None:
    """The call's W3C ``traceparent`` metadata, the parent of its trace when sampled."""
    for key, value in context.invocation_metadata():
        if key == "traceparent":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


def trace_changes(request: Any) -> dict[str, str | list[str] | None]:
    """Each setting's values; one sent with none clears it (a model's follows the global). The
    level is a list; any other setting is its one value."""
    changes: dict[str, str | list[str] | None] = {}
    for name, setting in request.settings.items():
        values = list(setting.value)
        one = values[0] if len(values) == 1 and name != "trace_level" else None
        changes[name] = one if one is not None else (values or None)
    return changes


def log_changes(request: Any) -> dict[str, object]:
    changes: dict[str, object] = {}
    for name, value in request.settings.items():
        which = value.WhichOneof("parameter_choice")
        if which is None:
            raise InvalidInput(f"log setting '{name[:64]}' has no value")
        changes[name] = getattr(value, which)
    return changes


def trace_reply(document: dict[str, object]) -> pb.TraceSettingResponse:
    reply = pb.TraceSettingResponse()
    for name, value in document.items():
        values = value if isinstance(value, list) else [value]
        reply.settings[name].value.extend(str(each) for each in values)
    return reply


def log_reply(document: dict[str, object]) -> pb.LogSettingsResponse:
    reply = pb.LogSettingsResponse()
    for name, value in document.items():
        setting = reply.settings[name]
        if isinstance(value, bool):
            setting.bool_param = value
        elif isinstance(value, int):
            setting.uint32_param = value
        else:
            setting.string_param = str(value)
    return reply


class DiagnosticsRpcs:
    """``TraceSetting`` and ``LogSettings``, answered through the service's ``_answer``."""

    _core: Core

    async def _answer(
        self, context: CallContext, work: Callable[[], Awaitable[Reply]], *, health: bool = False
    ) -> Reply:
        raise NotImplementedError

    async def TraceSetting(self, request: Any, context: CallContext) -> pb.TraceSettingResponse:
        async def setting() -> pb.TraceSettingResponse:
            diagnostics = self._core.diagnostics
            model = request.model_name or None
            if request.settings:
                changes = trace_changes(request)
                return trace_reply(await diagnostics.update_trace_setting(model, changes))
            return trace_reply(diagnostics.trace_setting(model))

        return await self._answer(context, setting)

    async def LogSettings(self, request: Any, context: CallContext) -> pb.LogSettingsResponse:
        async def settings() -> pb.LogSettingsResponse:
            diagnostics = self._core.diagnostics
            if request.settings:
                return log_reply(await diagnostics.update_log_settings(log_changes(request)))
            return log_reply(diagnostics.log_settings())

        return await self._answer(context, settings)
