"""The FastAPI app of the HTTP front: routes and middlewares over the serving core."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from nograd import __version__
from nograd.http import (
    diagnostics,
    openai,
    placement,
    repository,
    shared_memory,
    torchserve,
    v2,
)
from nograd.http.decoded import DecodedCalls
from nograd.http.direct import DirectRoutes
from nograd.http.errors import install_error_handlers
from nograd.http.middleware import (
    AdmissionMiddleware,
    AuthMiddleware,
    BodyBudget,
    BodyLimitMiddleware,
    HeadMiddleware,
    StartTimeMiddleware,
    UnexpectedErrorMiddleware,
)
from nograd.protocol.v2_schemas import InferRequestDocument
from nograd.serving.core import Core
from nograd.settings import Settings

logger = logging.getLogger(__name__)
Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def create_app(settings: Settings | None = None) -> FastAPI:
    """An app that serves on its own under any ASGI server (``uvicorn --factory``, tests): its
    lifespan runs the serving core's start-up and shutdown. ``nograd`` itself serves
    ``build_app`` from ``nograd.server``, beside gRPC."""
    core = Core(settings or Settings())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        del app
        await core.open()
        core.load_in_background()
        core.watch()
        try:
            yield
        finally:
            await core.close()

    return build_app(core, lifespan)


def build_app(core: Core, lifespan: Lifespan | None = None) -> FastAPI:
    """The HTTP front over ``core``: V2, OpenAI and repository routes, the inference calls served
    ahead of the router, the middlewares, ``/metrics``."""
    settings = core.settings
    metrics = core.metrics
    app = FastAPI(
        title="nograd",
        version=__version__,
        description="PyTorch model server: Open Inference Protocol (KServe V2), memory-sized "
        "dynamic batching, Prometheus metrics.",
        lifespan=lifespan,
        **_without_framework_telemetry(),
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.dataplane = core.plane
    app.state.control = core.control
    app.state.calls = core.calls
    app.state.torchserve = core.torchserve
    app.state.diagnostics = core.diagnostics
    app.state.placement = core.placement
    install_error_handlers(app)
    for middleware, options in reversed(own_middlewares(core)):
        app.add_middleware(middleware, **options)
    app.include_router(v2.router)
    app.include_router(repository.router)
    app.include_router(placement.router)
    app.include_router(shared_memory.router)
    app.include_router(diagnostics.router)
    app.include_router(openai.router)
    app.include_router(torchserve.router)

    @app.get(
        "/metrics",
        tags=["Observability"],
        summary="Prometheus metrics",
        response_class=PlainTextResponse,
        responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}}},
    )
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.exposition), media_type=CONTENT_TYPE_LATEST)

    _document_infer_schemas(app)
    return app


def own_middlewares(core: Core) -> list[tuple[Any, dict[str, Any]]]:
    """nograd's middlewares from the outside in, each with its options. Auth and admission read
    headers only, so a request they refuse never has its body read; then the size limit, which
    reads a chunked body as it arrives; innermost the inference calls served ahead of the router."""
    settings, calls = core.settings, core.calls
    auth = [
        (
            AuthMiddleware,
            {
                "calls": calls,
                "protect_health": settings.auth_health,
                "protect_metrics": settings.auth_metrics,
            },
        )
    ]
    return [
        (UnexpectedErrorMiddleware, {}),
        (StartTimeMiddleware, {}),
        (HeadMiddleware, {}),
        *(auth if calls.keys_required else []),
        (AdmissionMiddleware, {"calls": calls}),
        (BodyLimitMiddleware, {"budget": body_budget(core)}),
        (DirectRoutes, {"calls": calls}),
    ]


def body_budget(core: Core) -> BodyBudget:
    """The request-size limit and byte budget every body is held in, over the serving core."""
    return BodyBudget(
        core.settings.max_request_bytes, core.metrics, core.plane.models.__contains__, core.calls
    )


def build_decoded_calls(core: Core) -> DecodedCalls:
    """What the engine process serves the V2 inference calls its fronts decoded with
    (``nograd.http.decoded``): the size limit and byte budget ``BodyLimitMiddleware`` checks."""
    return DecodedCalls(core.calls, body_budget(core))


def _without_framework_telemetry() -> dict[str, Any]:
    """Turn off FastAPI's built-in OpenTelemetry hooks where this FastAPI has them.

    nograd exports its own Prometheus metrics; the framework's check for a configured tracer runs
    on every request and was the largest single cost of the event loop in profiles.
    """
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def _document_infer_schemas(app: FastAPI) -> None:
    """Put the hand-parsed infer body's schema pieces into the OpenAPI components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        defs = InferRequestDocument.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs.pop("$defs", {}))
        components["InferRequestDocument"] = defs
        for path in schema["paths"].values():
            body = path.get("post", {}).get("requestBody")
            if body is not None and "InferRequestDocument" in str(body):
                body["content"]["application/json"]["schema"] = {
                    "$ref": "#/components/schemas/InferRequestDocument"
                }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
