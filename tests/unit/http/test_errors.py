"""An error nobody foresaw: the client learns that it failed, the log learns why."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import FastAPI

from nograd.http.error_bodies import UNEXPECTED
from nograd.http.errors import install_error_handlers
from nograd.http.middleware import UnexpectedErrorMiddleware


async def test_an_unexpected_error_answers_500_without_the_servers_internals(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("cannot open /srv/models/secret/model.py")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    with caplog.at_level(logging.ERROR):
        async with httpx.AsyncClient(transport=transport, base_url="http://nograd") as client:
            answer = await client.get("/boom")
    assert answer.status_code == 500
    message = answer.json()["error"]
    assert message.startswith("internal error")
    assert "/srv" not in message and "RuntimeError" not in message
    assert "/srv/models/secret/model.py" in caplog.text


async def test_an_unexpected_error_ends_in_an_answer_not_in_the_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The app answers the 500 itself and raises nothing on to the server (which would reset
    the connection the client reuses for its next request)."""
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(UnexpectedErrorMiddleware)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("cannot open /srv/models/secret/model.py")

    @app.get("/fine")
    async def fine() -> dict[str, bool]:
        return {"fine": True}

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
    with caplog.at_level(logging.ERROR):
        async with httpx.AsyncClient(transport=transport, base_url="http://nograd") as client:
            answer = await client.get("/boom")
            assert (await client.get("/fine")).json() == {"fine": True}
    assert answer.status_code == 500
    assert answer.json()["error"] == UNEXPECTED
    assert "/srv/models/secret/model.py" in caplog.text
