"""TorchServe archives served as they are: a model store of ``.mar`` files built by the real
``torch-model-archiver`` from TorchServe's examples, beside a nograd model folder, answered over
TorchServe's own API on nograd's port."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from tests.e2e.serving import ROOT, Server, metric_value, run_server
from tests.torchserve_archives import DIGITS, MNIST, build_store

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("torchserve")
    build_store(root / "store", root / "work")
    shutil.copytree(ROOT / "models" / "digits", root / "store" / "digits")
    return root


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[Server]:
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(store / "store"),
        "NOGRAD_ENGINE_CACHE": str(store / "cache"),
        # An archive is not warmed up (its handler reads request bodies): the first batches'
        # times must not shed the concurrent burst on a loaded 2-core box.
        "NOGRAD_MAX_QUEUE_WAIT_S": "60",
    }
    with run_server(store, env) as running:
        yield running


def mnist_reference(store: Path, images: list[bytes]) -> list[int]:
    """What TorchServe's MNIST handler answers, computed from its parts: ``mnist.py``'s Net
    with the archived weights, torchvision's ToTensor and Normalize((0.1307,), (0.3081,)) as
    arithmetic, and the handler's ``argmax(1).tolist()``."""
    spec = importlib.util.spec_from_file_location("ts_reference_mnist", MNIST / "mnist.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    net = module.Net()
    net.load_state_dict(torch.load(store / "work" / "mnist_cnn.pt", weights_only=True))
    net.eval()
    rows = []
    for raw in images:
        pixels = np.asarray(Image.open(io.BytesIO(raw)), dtype=np.uint8)
        tensor = torch.from_numpy(pixels.copy()).to(torch.float32).div(255)[None]
        rows.append((tensor - 0.1307) / 0.3081)
    with torch.inference_mode():
        return list(net(torch.stack(rows)).argmax(1).tolist())


def test_ping_and_models(server: Server) -> None:
    ping = httpx.get(f"{server.url}/ping")
    assert (ping.status_code, ping.json()) == (200, {"status": "Healthy"})
    listed = httpx.get(f"{server.url}/models").json()["models"]
    assert {"modelName": "mnist", "modelUrl": "mnist.mar"} in listed
    assert {"modelName": "scale", "modelUrl": "scale.mar"} in listed
    assert "digits" in {row["modelName"] for row in listed}
    described = httpx.get(f"{server.url}/models/mnist").json()
    assert len(described) == 1
    mnist = described[0]
    assert (mnist["modelName"], mnist["modelVersion"], mnist["status"]) == ("mnist", "1.0", "READY")
    assert (mnist["batchSize"], mnist["maxBatchDelay"]) == (8, 200)
    assert (mnist["minWorkers"], mnist["maxWorkers"], mnist["responseTimeout"]) == (1, 1, 120)
    assert httpx.get(f"{server.url}/models/scale/2.1").json()[0]["modelVersion"] == "2.1"


def test_unknown_model_and_version(server: Server) -> None:
    missing = httpx.post(f"{server.url}/predictions/nope", content=b"x")
    assert missing.status_code == 404
    assert missing.json() == {
        "code": 404,
        "type": "ModelNotFoundException",
        "message": "Model not found: nope",
    }
    assert httpx.get(f"{server.url}/models/nope").json()["type"] == "ModelNotFoundException"
    wrong = httpx.post(f"{server.url}/predictions/mnist/9.9", content=DIGITS["0"])
    assert wrong.status_code == 404
    assert wrong.json()["message"] == "Model version: 9.9 does not exist for model: mnist"


def test_mnist_answers_as_torchserve(server: Server, store: Path) -> None:
    expected = mnist_reference(store, list(DIGITS.values()))
    for (name, image), want in zip(DIGITS.items(), expected, strict=True):
        put = httpx.put(f"{server.url}/predictions/mnist", content=image)  # curl -T
        posted = httpx.post(f"{server.url}/predictions/mnist/1.0", content=image)
        form = httpx.post(
            f"{server.url}/predictions/mnist", files={"data": (f"{name}.png", image, "image/png")}
        )
        for response in (put, posted, form):
            assert response.status_code == 200, response.text
            assert response.json() == want


def test_function_handler_and_prediction_exception(server: Server) -> None:
    torch.manual_seed(1)
    linear = torch.nn.Linear(4, 2)
    x = [1.0, 2.0, 3.0, 4.0]
    with torch.inference_mode():
        want = linear(torch.tensor([x])).tolist()[0]
    answer = httpx.post(f"{server.url}/predictions/scale", json={"x": x})
    assert answer.status_code == 200, answer.text
    assert answer.json()["y"] == pytest.approx(want, abs=1e-6)
    refused = httpx.post(f"{server.url}/predictions/scale", content=b"not json")
    assert refused.status_code == 513
    assert refused.json() == {
        "code": 513,
        "type": "InternalServerException",
        "message": "send a JSON object with a list 'x' of 4 numbers",
    }


def test_concurrent_requests_are_batched(server: Server, store: Path) -> None:
    images = [DIGITS[name] for name in ("0", "1", "7", "0")] * 4
    expected = mnist_reference(store, images)
    batches_before = metric_value(server.url, "nograd_batch_size_count", model="mnist")

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(
                *(client.put("/predictions/mnist", content=image) for image in images)
            )

    responses = asyncio.run(send_all())
    assert [r.json() for r in responses] == expected
    batches = metric_value(server.url, "nograd_batch_size_count", model="mnist") - batches_before
    assert 1 <= batches < len(images), f"{batches} batches for {len(images)} requests"


def test_handler_imports_its_archive_files_lazily(server: Server) -> None:
    """A file of the archive imported inside ``handle`` (after load) is found, batch after
    batch, and is the archive's own module."""
    for text in ("first", "second"):
        answer = httpx.post(f"{server.url}/predictions/lazy", json={"text": text})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"echo": {"text": text}, "helper": "lazy_helper"}
