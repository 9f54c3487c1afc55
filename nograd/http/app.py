"""Builds the FastAPI app: settings, metrics, data plane, routes and the startup/shutdown cycle."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from nograd import __version__
from nograd.grpc.server import GrpcServer
from nograd.http import openai, repository, v2
from nograd.http.direct import DirectRoutes
from nograd.http.errors import install_error_handlers
from nograd.http.middleware import (
    AdmissionMiddleware,
    AuthMiddleware,
    BodyLimitMiddleware,
    HeadMiddleware,
    StartTimeMiddleware,
)
from nograd.observability.metrics import Metrics
from nograd.observability.stats import Statistics
from nograd.protocol.v2_schemas import InferRequestDocument
from nograd.runtime.config import ConfigError
from nograd.serving.control import ModelControl
from nograd.serving.dataplane import DataPlane
from nograd.settings import Settings
from nograd.supervisor.worker import WorkerContext

logger = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, *, worker: WorkerContext | None = None) -> FastAPI:
    """The app of one server process; ``worker`` when it is one of several sharing a port."""
    settings = settings or Settings()
    shared_dir = worker.shared_dir if worker else None
    metrics = Metrics(multiprocess_dir=shared_dir)
    plane = DataPlane(
        settings, metrics, Statistics(shared_dir), cores=worker.cores if worker else None
    )
    control = ModelControl(plane, shared_dir)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        del app
        await control.open()
        control.discover()
        grpc_server: GrpcServer | None = None
        try:
            if plane.config_errors:
                raise ConfigError("; ".join(plane.config_errors))
            # gRPC serves beside HTTP on this loop and data plane; its calls drain with HTTP's.
            # Bound now, so a port already taken fails the start-up before minutes of loading.
            if settings.grpc_port:
                grpc_server = GrpcServer(
                    settings, plane, control, metrics, shared_port=worker is not None
                )
        except Exception:
            await control.close()
            raise
        tasks = []
        if worker is None:
            # Models load after the server starts listening, so liveness answers and readiness
            # tells the truth (not ready) while weights load and warm up.
            if grpc_server is not None:
                await grpc_server.start()
            tasks.append(asyncio.create_task(control.load_startup(), name="load-models"))
        else:
            # The supervisor hands a worker connections only once it is warm; the kernel spreads
            # gRPC connections over every worker listening, so gRPC listens from then on too.
            await control.load_startup()
            if grpc_server is not None:
                await grpc_server.start()
            worker.ready()
        tasks.append(asyncio.create_task(plane.watch_batchers(), name="watch-batchers"))
        if settings.model_control == "poll":
            tasks.append(asyncio.create_task(control.poll_forever(), name="poll-repository"))
        try:
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace_s=1.0)
            for task in tasks:
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await control.close()
            await plane.stop(settings.drain_timeout_s)

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
    app.state.dataplane = plane
    app.state.control = control
    install_error_handlers(app)
    known = plane.models.__contains__
    app.add_middleware(DirectRoutes, plane=plane, metrics=metrics)
    # Starlette wraps the last-added middleware outermost. From the outside in: auth and
    # admission read headers only, so a request they refuse never has its body read; then the
    # size limit, which reads a chunked body as it arrives.
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_request_bytes,
        metrics=metrics,
        known_model=known,
    )
    app.add_middleware(AdmissionMiddleware, plane=plane, metrics=metrics)
    if settings.api_key_list:
        app.add_middleware(
            AuthMiddleware,
            keys=settings.api_key_list,
            metrics=metrics,
            known_model=known,
            protect_health=settings.auth_health,
            protect_metrics=settings.auth_metrics,
        )
    app.add_middleware(HeadMiddleware)
    app.add_middleware(StartTimeMiddleware)
    app.include_router(v2.router)
    app.include_router(repository.router)
    app.include_router(openai.router)

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
