"""System shared-memory regions are their caller's own: over the real HTTP app with two API keys,
a region one key registered is absent from the other's status, untouched by its unregister calls
and unknown to its inferences; a key prefix limits the objects that may be opened, with the same
answer for an object missing, outside the prefix or no plain file; the extension can be turned
off."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from nograd.http.app import create_app
from nograd.settings import Settings
from tests.unit.conftest import FIXTURES

X = np.array([[1.5, 2.5]], dtype=np.float32)
ALICE = {"authorization": "Bearer alice-key"}
BOB = {"authorization": "Bearer bob-key"}
CAROL = {"authorization": "Bearer carol-key"}
"""An inference key: shared-memory routes are operator keys' (403), and no region is hers."""


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "poison", repo / "poison")
    app: FastAPI = create_app(Settings(model_repository=repo, warmup=False, **settings))
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(app.state.dataplane.until_loaded(), 30)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://nograd") as client:
            yield client
        app.state.calls.shared_memory.close()


@pytest.fixture
def shm_object() -> Iterator[tuple[str, Path]]:
    """A 16-byte object in /dev/shm holding X then 8 free bytes: its key and its path."""
    name = f"nograd_iso_{uuid.uuid4().hex[:8]}"
    path = Path("/dev/shm") / name
    path.write_bytes(X.tobytes() + bytes(8))
    try:
        yield f"/{name}", path
    finally:
        path.unlink(missing_ok=True)


def _output_bytes(path: Path) -> bytes:
    """What the object holds after the input: where the outputs are written."""
    return path.read_bytes()[8:]


def _request(region: str) -> dict[str, Any]:
    placed = {"shared_memory_region": region, "shared_memory_byte_size": 8}
    output = {"shared_memory_region": region, "shared_memory_offset": 8}
    return {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "parameters": placed}],
        "outputs": [{"name": "y", "parameters": output | {"shared_memory_byte_size": 8}}],
    }


async def test_a_region_is_its_callers_own(tmp_path: Path, shm_object: tuple[str, Path]) -> None:
    key, path = shm_object
    keys = {"api_keys": SecretStr("carol-key"), "operator_api_keys": SecretStr("alice-key,bob-key")}
    async with serving(tmp_path, **keys) as client:
        body = {"key": key, "offset": 0, "byte_size": 16}
        register = "/v2/systemsharedmemory/region/r/register"
        answer = await client.post(register, json=body, headers=ALICE)
        assert answer.status_code == 200, answer.text
        assert [
            r["name"]
            for r in (await client.get("/v2/systemsharedmemory/status", headers=ALICE)).json()
        ] == ["r"]
        # Bob sees nothing of Alice's, and his calls leave her region alone.
        assert (await client.get("/v2/systemsharedmemory/status", headers=BOB)).json() == []
        one = await client.get("/v2/systemsharedmemory/region/r/status", headers=BOB)
        assert one.status_code == 404
        assert one.json()["error"] == "Unable to find system shared memory region: 'r'"
        used = await client.post("/v2/models/poison/infer", json=_request("r"), headers=BOB)
        assert used.status_code == 404, used.text
        assert used.json()["error"] == "Unable to find shared memory region: 'r'"
        assert _output_bytes(path) == bytes(8)
        inferred = await client.post("/v2/models/poison/infer", json=_request("r"), headers=CAROL)
        assert inferred.status_code == 404, inferred.text
        listed = await client.get("/v2/systemsharedmemory/status", headers=CAROL)
        assert listed.status_code == 403  # nothing written through Bob's request
        for route in ("region/r/unregister", "unregister"):
            gone = await client.post(f"/v2/systemsharedmemory/{route}", headers=BOB)
            assert gone.status_code == 200
        assert len((await client.get("/v2/systemsharedmemory/status", headers=ALICE)).json()) == 1
        # Names are per caller: Bob registers his own "r".
        mine = await client.post(register, json={**body, "byte_size": 8}, headers=BOB)
        assert mine.status_code == 200, mine.text
        bobs = (await client.get("/v2/systemsharedmemory/status", headers=BOB)).json()
        assert bobs[0]["byte_size"] == 8
        # Alice's inference uses her region: her output is written after her input.
        served = await client.post("/v2/models/poison/infer", json=_request("r"), headers=ALICE)
        assert served.status_code == 200, served.text
        np.testing.assert_array_equal(np.frombuffer(_output_bytes(path), np.float32), X[0] * 2)
        await client.post("/v2/systemsharedmemory/unregister", headers=ALICE)
        assert (await client.get("/v2/systemsharedmemory/status", headers=ALICE)).json() == []
        assert len((await client.get("/v2/systemsharedmemory/status", headers=BOB)).json()) == 1


async def test_objects_outside_the_prefix_get_the_answer_of_a_missing_one(
    tmp_path: Path, shm_object: tuple[str, Path]
) -> None:
    key, path = shm_object
    folder = Path("/dev/shm") / f"nograd_iso_dir_{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    link = Path("/dev/shm") / f"nograd_iso_link_{uuid.uuid4().hex[:8]}"
    link.symlink_to(path)
    fifo = Path("/dev/shm") / f"nograd_iso_fifo_{uuid.uuid4().hex[:8]}"
    os.mkfifo(fifo)
    other = Path("/dev/shm") / f"nograd_other_{uuid.uuid4().hex[:8]}"
    other.write_bytes(bytes(16))
    try:
        async with serving(tmp_path, shared_memory_key_prefix="nograd_iso_") as client:
            for refused in (
                f"/{other.name}",  # outside the prefix, there
                "/nograd_elsewhere",  # outside the prefix, missing
                "/nograd_iso_missing",  # inside it, missing
                f"/{folder.name}",  # not a plain file
                f"/{fifo.name}",
                f"/{link.name}",  # a link
                "/../etc/passwd",
            ):
                body = {"key": refused, "offset": 0, "byte_size": 8}
                answer = await client.post("/v2/systemsharedmemory/region/r/register", json=body)
                assert answer.status_code == 400
                assert answer.json() == {
                    "error": f"Unable to open shared memory region: '{refused}'"
                }
            body = {"key": key, "offset": 0, "byte_size": 16}
            answer = await client.post("/v2/systemsharedmemory/region/r/register", json=body)
            assert answer.status_code == 200, answer.text
    finally:
        folder.rmdir()
        link.unlink()
        fifo.unlink()
        other.unlink()


async def test_turned_off_every_call_is_refused(
    tmp_path: Path, shm_object: tuple[str, Path]
) -> None:
    key, _ = shm_object
    async with serving(tmp_path, shared_memory=False) as client:
        body = {"key": key, "offset": 0, "byte_size": 16}
        for method, route, sent in (
            ("POST", "/v2/systemsharedmemory/region/r/register", body),
            ("GET", "/v2/systemsharedmemory/status", None),
            ("POST", "/v2/systemsharedmemory/unregister", None),
            ("GET", "/v2/cudasharedmemory/status", None),
            ("POST", "/v2/cudasharedmemory/region/c/register", {}),
            ("POST", "/v2/models/poison/infer", _request("r")),
        ):
            answer = await client.request(method, route, json=sent)
            assert answer.status_code == 501, (route, answer.text)
            assert "shared memory is turned off on this server" in answer.json()["error"]
        extensions = (await client.get("/v2")).json()["extensions"]
        assert "system_shared_memory" not in extensions
        assert "cuda_shared_memory" not in extensions
