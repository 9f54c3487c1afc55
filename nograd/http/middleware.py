"""ASGI middleware applied before any route runs: API-key auth, admission of inference work, the
request-size limit, HEAD on GET routes.

All are plain ASGI (no BaseHTTPMiddleware) so they add no task per request and can refuse a
request before its body is read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nograd.http.connections import STARTED_KEY
from nograd.http.error_bodies import UNEXPECTED, error_body, error_headers, openai_error_body
from nograd.http.paths import (
    EMBEDDINGS,
    OPENAI_PREFIX,
    TORCHSERVE_PING,
    TORCHSERVE_PREFIXES,
    infer_target,
    operator_group,
    predictions_target,
    route_path,
    v2_model,
)
from nograd.observability.metrics import UNKNOWN_MODEL, Metrics
from nograd.serving.calls.lifecycle import Calls
from nograd.serving.errors import Forbidden, QueueFull, Unauthenticated

logger = logging.getLogger(__name__)


def _error_body(path: str, status: int, message: str, code: str) -> bytes:
    if path.startswith(OPENAI_PREFIX):
        return openai_error_body(status, message, code=code)
    return error_body(message)


async def _respond(
    send: Send, path: str, status: int, message: str, code: str, headers: list[tuple[bytes, bytes]]
) -> None:
    body = _error_body(path, status, message, code)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def model_label(path: str, known: Callable[[str], bool]) -> str:
    """The model a path names, for metric labels; unknown names collapse to one value."""
    target = v2_model(path)
    if target is not None and known(target[0]):
        return target[0]
    return UNKNOWN_MODEL


class AuthMiddleware:
    """API keys on inference, metadata and management routes, and operator keys on the
    operator API groups (``Calls.authorize``: constant time, never logged). Health and metrics
    stay open unless configured otherwise, because probes and scrapers rarely carry
    credentials."""

    def __init__(
        self,
        app: ASGIApp,
        calls: Calls,
        *,
        protect_health: bool = False,
        protect_metrics: bool = False,
    ) -> None:
        self.app = app
        self._calls = calls
        self._protect_health = protect_health
        self._protect_metrics = protect_metrics

    def _protected(self, path: str) -> bool:
        if path.startswith("/v2/health/") or path == TORCHSERVE_PING:
            return self._protect_health
        if path == "/metrics":
            return self._protect_metrics
        return path.startswith(("/v2", "/v1", *TORCHSERVE_PREFIXES))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._calls.keys_required:
            await self.app(scope, receive, send)
            return
        path = route_path(scope)  # as the router matches it
        group = operator_group(path)
        if group is None and not self._protected(path):
            await self.app(scope, receive, send)
            return
        target = v2_model(path)
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        try:
            self._calls.authorize(values, "http", None if target is None else target[0], group)
        except (Unauthenticated, Forbidden) as exc:
            await refuse_key(send, path, exc)
            return
        await self.app(scope, receive, send)


async def refuse_key(send: Send, path: str, exc: Unauthenticated | Forbidden) -> None:
    """A call without a good key: 401, or 403 (Triton's answer to a restricted API), before a
    byte of its body is read; closing the connection stops its upload."""
    if isinstance(exc, Unauthenticated):
        await _respond(
            send,
            path,
            401,
            str(exc),
            "invalid_api_key",
            [(b"www-authenticate", b'Bearer realm="nograd"'), (b"connection", b"close")],
        )
        return
    await _respond(send, path, 403, str(exc), "forbidden", [(b"connection", b"close")])


async def refuse_overloaded(send: Send, path: str, exc: QueueFull) -> None:
    """503 with the refusal's Retry-After: an inference call over the process's bounds."""
    headers = [(k.lower().encode(), v.encode()) for k, v in error_headers(503, exc)]
    await _respond(send, path, 503, str(exc), "server_overloaded", headers)


class AdmissionMiddleware:
    """Admits inference requests into the data plane before their bodies are read, and refuses
    those over the process's bounds with 503 + Retry-After (``Calls.admit``)."""

    def __init__(self, app: ASGIApp, calls: Calls) -> None:
        self.app = app
        self._calls = calls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT"):
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        target = None if path == EMBEDDINGS else infer_target(path)
        if target is None:
            target = predictions_target(path)
        elif scope["method"] != "POST":
            target = None
        if target is None and path != EMBEDDINGS:
            await self.app(scope, receive, send)
            return
        try:
            arrived = scope.get("state", {}).get(STARTED_KEY)
            self._calls.admit(None if target is None else target[0], arrived)
        except QueueFull as exc:
            await refuse_overloaded(send, scope["path"], exc)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self._calls.release()


class BodyBudget:
    """The request-size limit and the process's byte budget a body is held in: what
    ``BodyLimitMiddleware`` checks, and the engine process checks for a call its front decoded
    (``nograd.http.decoded``)."""

    def __init__(
        self,
        max_bytes: int,
        metrics: Metrics,
        known_model: Callable[[str], bool],
        calls: Calls | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self._metrics = metrics
        self._known_model = known_model
        self._calls = calls

    async def refuse_too_large(self, path: str, send: Send) -> None:
        """413 for a body declared or counted over the limit."""
        self._metrics.rejected.labels(model_label(path, self._known_model), "too_large").inc()
        await _respond(
            send,
            path,
            413,
            f"request body exceeds the limit of {self.max_bytes} bytes (NOGRAD_MAX_REQUEST_BYTES)",
            "request_too_large",
            [(b"connection", b"close")],
        )

    async def took(self, path: str, send: Send, size: int) -> bool:
        """``size`` bytes drawn from the budget (True), or the request refused with 503."""
        if self._calls is None or not size:
            return True
        target = v2_model(path)
        try:
            self._calls.take_bytes(size, None if target is None else target[0])
        except QueueFull as exc:
            headers = [(k.lower().encode(), v.encode()) for k, v in error_headers(503, exc)]
            headers.append((b"connection", b"close"))  # the rest of the body is never read
            await _respond(send, path, 503, str(exc), "server_overloaded", headers)
            return False
        return True

    def give(self, size: int) -> None:
        if self._calls is not None and size:
            self._calls.give_bytes(size)


class BodyLimitMiddleware:
    """Refuse bodies over the limit with 413: by Content-Length before reading a byte, and by
    counting for chunked uploads, so an oversized body is never buffered whole. Each body's
    bytes are held in the process's byte budget (``Calls.take_bytes``) until its request is
    answered, taken the same way (by Content-Length, or chunk by chunk): one that does not fit
    is refused with 503 and Retry-After before the rest of it is read."""

    def __init__(self, app: ASGIApp, budget: BodyBudget) -> None:
        self.app = app
        self._budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > self._budget.max_bytes:
                await self._budget.refuse_too_large(scope["path"], send)
                return
            if declared >= 0:
                if not await self._budget.took(scope["path"], send, declared):
                    return
                try:
                    await self.app(scope, receive, send)
                finally:
                    self._budget.give(declared)
                return
        # No usable Content-Length (chunked): read up to the limit, then replay the body.
        held = 0
        try:
            chunks: list[bytes] = []
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    await self.app(scope, _replay([message], receive), send)
                    return
                chunk = message.get("body", b"")
                if held + len(chunk) > self._budget.max_bytes:
                    await self._budget.refuse_too_large(scope["path"], send)
                    return
                if not await self._budget.took(scope["path"], send, len(chunk)):
                    return
                held += len(chunk)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            del chunks
            await self.app(scope, _replay([whole], receive), send)
        finally:
            self._budget.give(held)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


class HeadMiddleware:
    """HEAD on a GET route answers as GET would, without the body (RFC 9110), instead of 405:
    probes and link checkers use it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if not message.get("more_body", False):
                    await send({"type": "http.response.body", "body": b""})
                return
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


class StartTimeMiddleware:
    """Stamps when a request entered the app, unless its connection already stamped when the
    request's head arrived (``GuardedProtocol``), so latency metrics and the queue-wait bound
    include parsing, routing and event-loop waits, not only the route's own work."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {}).setdefault(STARTED_KEY, time.perf_counter())
        await self.app(scope, receive, send)


class UnexpectedErrorMiddleware:
    """A failure no handler answered gets a 500 naming no server internals (the log has the
    traceback), and its connection stays open for the client's next request: Starlette's own
    last resort answers, then raises on to the server, which resets the connection. Only a
    failure after the answer began (its head already sent) still ends the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            if started:
                raise
            logger.exception("unhandled error on %s %s", scope["method"], scope["path"])
            await answer_unexpected(send, scope["path"])


async def answer_unexpected(send: Send, path: str) -> None:
    """500 naming no server internals, for a failure no handler answered."""
    await _respond(send, path, 500, UNEXPECTED, "internal_error", [])
