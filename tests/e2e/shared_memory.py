"""What the system and CUDA shared-memory e2e tests share: a server of Triton's ``simple``,
``simple_string`` and ``simple_identity`` models, and the check that offsets outside a region are
refused."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.e2e.serving import Server, free_port, run_server
from tests.triton_models import FIXTURES


def simple_repository(root: Path) -> Path:
    repo = root / "repo"
    for name in ("simple", "simple_string", "simple_identity"):
        shutil.copytree(FIXTURES / name, repo / name)
    return repo


@contextmanager
def simple_server(root: Path, workers: int | None = None) -> Iterator[Server]:
    """A server of ``simple_repository`` over HTTP and gRPC (``workers`` processes, when given)."""
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(simple_repository(root)),
        "NOGRAD_GRPC_PORT": str(free_port()),
    }
    if workers is not None:
        env["NOGRAD_WORKERS"] = str(workers)
    with run_server(root, env=env, ready_timeout_s=120) as running:
        yield running


def assert_outside_offsets_refused(url: str, region: str, size: int) -> None:
    """``simple``'s two inputs placed past the end of a ``size``-byte region: a clear 400 each,
    with Triton's wording."""
    for offset, error in (
        (size, "Invalid offset for shared memory region"),
        (4, "Invalid offset + byte size for shared memory region"),
    ):
        parameters = {
            "shared_memory_region": region,
            "shared_memory_offset": offset,
            "shared_memory_byte_size": size,
        }
        request = {
            "inputs": [
                {"name": n, "datatype": "INT32", "shape": [1, 16], "parameters": parameters}
                for n in ("INPUT0", "INPUT1")
            ]
        }
        answer = httpx.post(f"{url}/v2/models/simple/infer", json=request)
        assert answer.status_code == 400, answer.text
        assert error in answer.json()["error"]
