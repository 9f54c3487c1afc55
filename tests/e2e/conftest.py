"""A session-wide real server: started once with the shipped models, shared by e2e tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.serving import Server, run_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(tmp_path_factory.mktemp("server")) as running:
        yield running


@pytest.fixture(scope="session")
def server_url(server: Server) -> str:
    return server.url
