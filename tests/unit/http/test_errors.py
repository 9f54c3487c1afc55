"""An error nobody foresaw: the client learns that it failed, the log learns why."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import FastAPI

from nograd.http.errors import install_error_handlers


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
