"""The inference routes served straight from ASGI, ahead of the framework's router.

An inference call is the one request a model server answers thousands of times a second. Behind
FastAPI's exception middlewares, exit stacks, router scan and dependency solver it paid for all of
them on every call (about half of the event loop's time for a small model in profiles), though
the routes parse their own bodies and handle their own errors. This layer sits inside nograd's
own middlewares (start time, body limit, auth), so those still apply, and hands the call to the
very functions the FastAPI routes use, without Starlette's request and response objects (see
``nograd.http.exchange``); the routes stay registered for the OpenAPI schema and for every path this
layer does not claim.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from nograd.http import openai, v2
from nograd.http.exchange import Incoming
from nograd.http.paths import EMBEDDINGS, infer_target, route_path
from nograd.serving.calls.lifecycle import Calls


class DirectRoutes:
    def __init__(self, app: ASGIApp, calls: Calls) -> None:
        self.app = app
        self._calls = calls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = route_path(scope)
            target = None if path == EMBEDDINGS else infer_target(path)
            if path == EMBEDDINGS or target is not None:
                incoming = Incoming(scope, receive)
                if target is None:
                    reply = await openai.embeddings_call(incoming, self._calls)
                else:
                    name, version = target
                    reply = await v2.infer_call(incoming, self._calls, name, version)
                await reply.send(send)
                return
        await self.app(scope, receive, send)
