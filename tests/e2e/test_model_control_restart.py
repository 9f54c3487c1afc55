"""Every worker of a two-worker server serves the same models after control calls (API keys on,
explicit model control), a worker killed and restarted included: a load that only partly
succeeded, a load with an override, an unload, a version added on disk and not loaded, and the
cap on loaded model versions (NOGRAD_MAX_LOADED_MODELS).

The tests of this module run in order on one server, each building on the calls before it."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from tests.e2e.serving import ROOT, Server, free_port, run_server, wait_for_log, worker_pids

pytestmark = pytest.mark.e2e

DIGITS = ROOT / "models" / "digits"
BODY = {"inputs": json.loads((DIGITS / "sample.json").read_text())["inputs"]}
VERSION_FILES = ("model.py", "model.safetensors", "sample.json")
KEY = "restart-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAP = 3


def add_model(repo: Path, name: str, policy: str) -> None:
    """A copy of digits named ``name`` with numbered version folders and ``policy``."""
    (repo / name).mkdir(parents=True)
    config = (DIGITS / "config.toml").read_text()
    named = config.replace('name = "digits"', f'name = "{name}"\nversion_policy = {policy}')
    (repo / name / "config.toml").write_text(named)


def add_version(repo: Path, name: str, version: int, *, broken: bool = False) -> None:
    folder = repo / name / str(version)
    folder.mkdir()
    for file in VERSION_FILES:
        shutil.copy2(DIGITS / file, folder / file)
    if broken:
        (folder / "model.safetensors").write_bytes(b"not safetensors")


class Served:
    def __init__(self, server: Server, repo: Path) -> None:
        self.server = server
        self.repo = repo

    def control(
        self, call: str, name: str, config: dict[str, object] | None = None
    ) -> httpx.Response:
        body = None if config is None else {"parameters": {"config": json.dumps(config)}}
        url = f"{self.server.url}/v2/repository/models/{name}/{call}"
        return httpx.post(url, json=body, headers=AUTH, timeout=120)

    def answers(self, path: str, requests: int = 12) -> Counter[str]:
        """How each of ``requests`` inferences on new connections (spread over both workers by
        the supervisor) was answered: the version, or the status."""
        seen: Counter[str] = Counter()
        for _ in range(requests):
            answer = httpx.post(f"{self.server.url}{path}", json=BODY, headers=AUTH, timeout=30)
            ok = answer.status_code == 200
            seen[f"v{answer.json()['model_version']}" if ok else str(answer.status_code)] += 1
        return seen

    def batch_limits(self, name: str, requests: int = 8) -> set[str]:
        url = f"{self.server.url}/v2/models/{name}/config"
        return {
            httpx.get(url, headers=AUTH, timeout=10).json()["parameters"]["batch_limit"][
                "string_value"
            ]
            for _ in range(requests)
        }


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    repo = tmp_path_factory.mktemp("repository")
    add_model(repo, "digits", "{ latest = 1 }")
    add_version(repo, "digits", 1)
    add_model(repo, "pair", '"all"')
    add_version(repo, "pair", 1)
    add_version(repo, "pair", 2, broken=True)
    for name in ("copy", "extra"):
        add_model(repo, name, "{ latest = 1 }")
        add_version(repo, name, 1)
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_WORKERS": "2",
        "NOGRAD_MODEL_CONTROL": "explicit",
        "NOGRAD_LOAD_MODELS": "digits",
        "NOGRAD_MAX_LOADED_MODELS": str(CAP),
        "NOGRAD_API_KEYS": KEY,
        "NOGRAD_OPERATOR_API_KEYS": KEY,
        "NOGRAD_ENGINE": "eager",
        "NOGRAD_LOG_FORMAT": "text",
        "NOGRAD_GRPC_PORT": str(free_port()),
    }
    with run_server(tmp_path_factory.mktemp("log"), env) as server:
        yield Served(server, repo)


def test_a_load_that_partly_failed_serves_the_same_on_every_worker(served: Served) -> None:
    # Version 2 cannot load: the call says so, and version 1, which loaded, serves on both
    # workers (before, it served on the worker that took the call only: half the calls 404).
    answer = served.control("load", "pair")
    assert answer.status_code == 400
    assert "version 2: failed to load" in answer.json()["error"]
    assert served.answers("/v2/models/pair/infer") == {"v1": 12}


def test_a_load_over_the_cap_is_refused_naming_it(served: Served) -> None:
    assert served.control("load", "copy", {"max_batch_size": 4}).status_code == 200
    # digits, pair v1 and copy: three versions loaded, the cap.
    answer = served.control("load", "extra")
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert "NOGRAD_MAX_LOADED_MODELS" in error and f"cap of {CAP}" in error
    assert served.answers("/v2/models/extra/infer", 4) == {"404": 4}
    assert served.server.grpc_address is not None
    client = triton_grpc.InferenceServerClient(served.server.grpc_address)
    with pytest.raises(InferenceServerException, match="NOGRAD_MAX_LOADED_MODELS") as refused:
        client.load_model("extra", headers={"authorization": f"Bearer {KEY}"})
    assert refused.value.status() == "StatusCode.FAILED_PRECONDITION"
    # A reload of a model already counted replaces its versions: not refused.
    assert served.control("load", "copy", {"max_batch_size": 4}).status_code == 200


def test_a_restarted_worker_serves_what_its_sibling_serves(served: Served) -> None:
    assert served.control("unload", "digits").status_code == 200
    # A version added on disk and not loaded: the workers serve version 1 until a load call.
    add_version(served.repo, "copy", 2)
    pids = worker_pids(served.server)
    os.kill(pids[0], signal.SIGKILL)
    wait_for_log(served.server, "worker 0 ready after", times=2)
    assert worker_pids(served.server)[0] != pids[0]
    assert served.answers("/v2/models/copy/infer") == {"v1": 12}
    assert served.answers("/v2/models/copy/versions/1/infer") == {"v1": 12}
    assert served.batch_limits("copy") == {"4"}, "the override, on the restarted worker too"
    assert served.answers("/v2/models/pair/infer") == {"v1": 12}
    assert served.answers("/v2/models/digits/infer") == {"404": 12}
    url = f"{served.server.url}/v2/repository/index"
    ready = {httpx.post(url, json={"ready": True}, headers=AUTH, timeout=10).text for _ in range(8)}
    assert [json.loads(index) for index in ready] == [
        [
            {"name": "copy", "version": "1", "state": "READY"},
            {"name": "pair", "version": "1", "state": "READY"},
        ]
    ]
    # The next load call applies the new version on every worker.
    assert served.control("load", "copy").status_code == 200
    assert served.answers("/v2/models/copy/infer") == {"v2": 12}
    assert served.batch_limits("copy") == {"64"}
