"""TorchServe archives served as they are: a model store of ``.mar`` files built by the real
``torch-model-archiver`` from TorchServe's examples, beside a nograd model folder, answered over
TorchServe's own API on nograd's port; and registered, scaled and unregistered by TorchServe's
management calls on a server of two workers under explicit model control; unpacked only when
registered, removed when unregistered, and refused when its manifest names files outside it."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import io
import json
import shutil
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton
from PIL import Image
from tritonclient.utils import InferenceServerException

from tests.e2e.serving import ROOT, Server, free_port, metric_value, run_server
from tests.torchserve_archives import DIGITS, MNIST, build_store
from tests.torchserve_exchanges import EXCHANGES, differences, recorded_answers, send

pytestmark = pytest.mark.e2e
KEY = "ts-management-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("torchserve")
    build_store(root / "store", root / "work")
    # A sample request beside the archive: mnist is warmed up and measured with it.
    shutil.copy(MNIST / "0.png", root / "store" / "mnist.sample.png")
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
        # The repository is followed: an archive added or removed is loaded or unloaded.
        "NOGRAD_MODEL_CONTROL": "poll",
        "NOGRAD_REPOSITORY_POLL_S": "0.5",
        "NOGRAD_GRPC_PORT": str(free_port()),
    }
    with run_server(store, env) as running:
        yield running


@pytest.fixture(scope="module")
def managed(store: Path) -> Iterator[Server]:
    """Two workers, explicit model control, API keys, nothing loaded at start-up."""
    repository = store / "managed"
    repository.mkdir()
    for name in ("scale.mar", "lazy.mar", "mnist.mar", "mnist.sample.png"):
        shutil.copy(store / "store" / name, repository / name)
    env = {
        # A budget that holds about four MNIST samples' activations per worker: the memory plan,
        # measured with the sample request, caps the batch below the archive's batchSize of 8.
        "NOGRAD_MEMORY_BUDGET_BYTES": str(5_000_000),
        "NOGRAD_MODEL_REPOSITORY": str(repository),
        "NOGRAD_ENGINE_CACHE": str(store / "cache"),
        "NOGRAD_MODEL_CONTROL": "explicit",
        "NOGRAD_WORKERS": "2",
        "NOGRAD_API_KEYS": KEY,
        "NOGRAD_OPERATOR_API_KEYS": KEY,
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
    assert (mnist["modelName"], mnist["modelVersion"]) == ("mnist", "1.0")
    assert mnist["workers"][0]["status"] == mnist["nograd"]["status"] == "READY"
    assert (mnist["batchSize"], mnist["maxBatchDelay"]) == (8, 200)
    assert (mnist["minWorkers"], mnist["maxWorkers"], mnist["responseTimeout"]) == (1, 1, 120)
    assert httpx.get(f"{server.url}/models/scale/2.1").json()[0]["modelVersion"] == "2.1"
    # mnist has a sample request: warmed up and measured, its limit from the memory plan.
    log = server.log()
    assert "model mnist: sample request" in log
    summary = server.ready_summary()["mnist"]  # measured for the memory plan at start-up
    assert summary["format"] == "torchserve" and summary["profile_s"] > 0
    assert summary["batch_bytes"] > 0 and summary["limit"] == mnist["nograd"]["batchLimit"]
    assert "model scale: no usable sample request (none found" in log
    assert 1 <= mnist["nograd"]["batchLimit"] <= 8


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


def test_answers_equal_torchserves(server: Server) -> None:
    """Every call of ``tests/torchserve_exchanges.py`` answered as real TorchServe answered it
    (``scripts/record_torchserve_answers.py``): status, media type and body, floats within
    1e-5, one call at a time on one connection."""
    recorded = recorded_answers()
    assert sorted(recorded) == sorted(exchange.name for exchange in EXCHANGES)
    base = {"inference": server.url, "management": server.url}
    with httpx.Client(timeout=60) as client:
        found = {
            exchange.name: differences(
                exchange, recorded[exchange.name], send(client, base, exchange)
            )
            for exchange in EXCHANGES
        }
    failed = {name: diff for name, diff in found.items() if diff}
    assert not failed, json.dumps(failed, indent=1)


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


def test_a_body_the_handler_cannot_read_is_an_internal_server_exception(server: Server) -> None:
    """mnist given a non-image: its handler raises, and TorchServe's frontend sends a worker's
    failure as an ``InternalServerException`` (``RestJob.sendError``; recorded for
    ``headers.mar`` as ``headers-status-nan``), 503 ``Prediction failed``."""
    not_an_image = httpx.put(f"{server.url}/predictions/mnist", content=b"not an image")
    assert _status(not_an_image) == _ts_error(503, "InternalServerException", "Prediction failed")


def _send_at_once(url: str, method: str, path: str, bodies: list[bytes]) -> list[httpx.Response]:
    """Every body sent to ``path`` at the same time, each on a request of its own."""

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(
                *(client.request(method, path, content=body) for body in bodies)
            )

    return asyncio.run(send_all())


def _batch_sizes(url: str, model: str) -> dict[str, float]:
    """The model's ``nograd_batch_size`` histogram: batches run, rows in them, and batches of
    at most 1, ``n`` rows (``le_n``)."""
    sizes = {
        "count": metric_value(url, "nograd_batch_size_count", model=model),
        "rows": metric_value(url, "nograd_batch_size_sum", model=model),
    }
    for bound in (1, 2, 4, 8):
        sizes[f"le_{bound}"] = metric_value(
            url, "nograd_batch_size_bucket", model=model, le=f"{bound}.0"
        )
    return sizes


def _assert_batched(
    before: dict[str, float], after: dict[str, float], requests: int, batch_size: int
) -> None:
    """The ``requests`` sent since ``before`` ran as batches of the model's handler: every
    request in exactly one, at least one batch of two or more, none over ``batch_size``."""
    ran = {key: after[key] - before[key] for key in after}
    assert ran["rows"] == requests, ran
    assert 1 <= ran["count"] < requests, ran
    assert ran["count"] - ran["le_1"] >= 1, f"no batch of more than one request: {ran}"
    assert ran[f"le_{batch_size}"] == ran["count"], f"a batch over batchSize {batch_size}: {ran}"


def test_concurrent_requests_are_batched(server: Server, store: Path) -> None:
    """16 requests sent at once reach the handler in batches (model-config.yaml's batchSize 8,
    maxBatchDelay 200 ms), each answered with its own digit."""
    images = [DIGITS[name] for name in ("0", "1", "7", "0")] * 4
    expected = mnist_reference(store, images)
    before = _batch_sizes(server.url, "mnist")
    responses = _send_at_once(server.url, "PUT", "/predictions/mnist", images)
    assert [r.json() for r in responses] == expected
    _assert_batched(before, _batch_sizes(server.url, "mnist"), len(images), 8)


def _photo(width: int, height: int, seed: int) -> bytes:
    """A PNG of seeded RGB noise."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def segmenter_reference(store: Path, images: list[bytes]) -> list[object]:
    """What TorchServe's ``image_segmenter`` answers, computed from its parts: torchvision's
    Resize(256) (PIL bilinear on the shorter edge), CenterCrop(224), ToTensor and ImageNet's
    Normalize as arithmetic; the archived model's ``out``; softmax over the classes and, per
    pixel, ``[top class as a float, its probability]``."""
    rows = []
    for raw in images:
        image = Image.open(io.BytesIO(raw)).convert("RGB")
        width, height = image.size
        scale = 256 / min(width, height)
        size = (256, int(height * scale)) if width <= height else (int(width * scale), 256)
        pixels = np.asarray(image.resize(size, Image.Resampling.BILINEAR), dtype=np.float32)
        top, left = round((size[1] - 224) / 2), round((size[0] - 224) / 2)
        crop = pixels[top : top + 224, left : left + 224] / 255
        mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
        rows.append(torch.from_numpy(((crop - mean) / std).transpose(2, 0, 1).astype(np.float32)))
    model = torch.jit.load(str(store / "work" / "segment.pt"))  # type: ignore[no-untyped-call]
    with torch.inference_mode():
        probabilities = torch.softmax(model(torch.stack(rows))["out"], dim=1)
    values, indices = probabilities.max(dim=1)
    return [
        [[[float(c), p] for c, p in zip(cs, ps, strict=True)] for cs, ps in zip(*pair, strict=True)]
        for pair in zip(indices.tolist(), values.tolist(), strict=True)
    ]


def test_default_image_segmenter_answers_as_torchserve(server: Server, store: Path) -> None:
    """Images of several sizes sent at once: batched (the archive's batchSize is 4), each
    answered with its own 28x28 grid of [class, probability] as TorchServe computes it."""
    images = [_photo(300, 256, 0), _photo(240, 320, 1), _photo(224, 224, 2)] * 2
    expected = segmenter_reference(store, images)
    before = _batch_sizes(server.url, "segment")
    responses = _send_at_once(server.url, "POST", "/predictions/segment", images)
    for response, want in zip(responses, expected, strict=True):
        assert response.status_code == 200, response.text
        got = response.json()
        assert np.asarray(got).shape == (28, 28, 2)
        assert np.array_equal(np.asarray(got)[..., 0], np.asarray(want)[..., 0])
        assert np.allclose(np.asarray(got)[..., 1], np.asarray(want)[..., 1], atol=1e-5)
    _assert_batched(before, _batch_sizes(server.url, "segment"), len(images), 4)


def test_handler_imports_its_archive_files_lazily(server: Server) -> None:
    """A file of the archive imported inside ``handle`` (after load) is found, batch after
    batch, and is the archive's own module."""
    for text in ("first", "second"):
        answer = httpx.post(f"{server.url}/predictions/lazy", json={"text": text})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"echo": {"text": text}, "helper": "lazy_helper"}


def _status(response: httpx.Response) -> tuple[int, object]:
    return response.status_code, response.json()


def _ts_error(code: int, kind: str, message: str) -> tuple[int, object]:
    return code, {"code": code, "type": kind, "message": message}


def _answers_on_fresh_connections(url: str, path: str, count: int = 6) -> list[int]:
    """Status codes of ``count`` predictions, each on its own connection (so both workers
    answer some)."""
    return [
        httpx.post(f"{url}{path}", json={"x": [1.0, 2.0, 3.0, 4.0]}, headers=AUTH).status_code
        for _ in range(count)
    ]


def test_register_scale_unregister_on_every_worker(managed: Server) -> None:
    """Every answer, and the ``minWorkers``/``maxWorkers`` that describe reports after each
    register and scale call, as TorchServe 0.12 gave them for the same calls on ``scale.mar``."""
    url = managed.url
    assert httpx.post(f"{url}/models?url=scale.mar").status_code == 401
    registered = httpx.post(
        f"{url}/models?url=scale.mar&initial_workers=2&synchronous=true", headers=AUTH, timeout=60
    )
    assert _status(registered) == (
        200,
        {"status": 'Model "scale" Version: 2.1 registered with 2 initial workers'},
    )
    assert _answers_on_fresh_connections(url, "/predictions/scale") == [200] * 6
    again = httpx.post(f"{url}/models?url=scale.mar", headers=AUTH)
    assert _status(again) == _ts_error(
        409, "ConflictStatusException", "Model version 2.1 is already registered for model scale"
    )
    assert _described_workers(url, "scale") == {(2, 2)}
    scaled = httpx.put(f"{url}/models/scale?min_worker=3&synchronous=true", headers=AUTH)
    assert _status(scaled) == (200, {"status": "Workers scaled to 3 for model: scale"})
    assert _described_workers(url, "scale") == {(3, 3)}
    later = httpx.put(f"{url}/models/scale/2.1?min_worker=2", headers=AUTH)
    assert _status(later) == (202, {"status": "Processing worker updates..."})
    assert _described_workers(url, "scale") == {(2, 2)}
    wider = httpx.put(f"{url}/models/scale?min_worker=1&max_worker=4", headers=AUTH)
    assert wider.status_code == 202
    assert _described_workers(url, "scale") == {(1, 4)}
    wrong = httpx.delete(f"{url}/models/scale/9.9", headers=AUTH)
    assert _status(wrong) == _ts_error(
        404, "ModelVersionNotFoundException", "Model version: 9.9 does not exist for model: scale"
    )
    removed = httpx.delete(f"{url}/models/scale", headers=AUTH, timeout=60)
    assert _status(removed) == (200, {"status": 'Model "scale" unregistered'})
    assert _answers_on_fresh_connections(url, "/predictions/scale") == [404] * 6
    gone = httpx.delete(f"{url}/models/scale", headers=AUTH)
    assert _status(gone)[0] == 404
    assert gone.json()["message"] == "Model not found: scale"
    assert httpx.put(f"{url}/models/scale", headers=AUTH).json()["type"] == (
        "ModelNotFoundException"
    )
    # The same archive through V2's repository API: one model control for both fronts.
    loaded = httpx.post(f"{url}/v2/repository/models/scale/load", headers=AUTH, timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert _answers_on_fresh_connections(url, "/predictions/scale", 4) == [200] * 4
    # Unregistering forgot the workers asked for: the archive's own (none: 1) are reported.
    assert _described_workers(url, "scale") == {(1, 1)}
    assert httpx.delete(f"{url}/models/scale", headers=AUTH, timeout=60).status_code == 200
    # No workers asked for: TorchServe registers the model without any (nograd loads it).
    none = httpx.post(f"{url}/models?url=scale.mar&initial_workers=-1", headers=AUTH, timeout=60)
    assert _status(none) == (
        200,
        {
            "status": 'Model "scale" Version: 2.1 registered with 0 initial workers. '
            "Use scale workers API to add workers for the model."
        },
    )
    assert _described_workers(url, "scale") == {(0, 0)}
    assert httpx.delete(f"{url}/models/scale", headers=AUTH, timeout=60).status_code == 200


def _described_workers(url: str, model: str, count: int = 6) -> set[tuple[int, int]]:
    """``(minWorkers, maxWorkers)`` as ``GET /models/{m}`` reports them, asked ``count`` times,
    each on its own connection (so every worker answers some)."""
    described = []
    for _ in range(count):
        answer = httpx.get(f"{url}/models/{model}", headers=AUTH)
        assert answer.status_code == 200, answer.text
        described.append((answer.json()[0]["minWorkers"], answer.json()[0]["maxWorkers"]))
    return set(described)


def test_register_answers_at_once_when_not_synchronous(managed: Server) -> None:
    accepted = httpx.post(f"{managed.url}/models?url=lazy.mar&synchronous=false", headers=AUTH)
    assert _status(accepted) == (202, {"status": "Processing worker updates..."})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        listed = httpx.get(f"{managed.url}/models", headers=AUTH).json()["models"]
        if {"modelName": "lazy", "modelUrl": "lazy.mar"} in listed:
            break
        time.sleep(0.2)
    answer = httpx.post(f"{managed.url}/predictions/lazy", json={"a": 1}, headers=AUTH)
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(
    ("query", "code", "message"),
    [
        ("", 400, "Parameter url is required."),
        ("url=", 404, "empty url"),
        ("url=../store/scale.mar", 404, "Relative path is not allowed in url: ../store/scale.mar"),
        (
            "url=https://example.com/scale.mar",
            404,
            "Given URL https://example.com/scale.mar does not match any allowed URL(s)",
        ),
        ("url=missing.mar", 404, "Model not found at: missing.mar"),
    ],
)
def test_register_refuses_a_url_outside_the_repository(
    managed: Server, query: str, code: int, message: str
) -> None:
    """TorchServe's status and body exactly (``ModelArchive.downloadModel``); why nograd
    refuses a file goes to its log."""
    refused = httpx.post(f"{managed.url}/models?{query}", headers=AUTH)
    kind = "BadRequestException" if code == 400 else "ModelNotFoundException"
    assert _status(refused) == _ts_error(code, kind, message)


def _until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.2)


def _v2_binary(url: str, model: str, bodies: list[bytes]) -> httpx.Response:
    """A V2 inference whose BYTES input ``body`` holds ``bodies`` as binary data."""
    elements = b"".join(len(body).to_bytes(4, "little") + body for body in bodies)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "body",
                    "shape": [len(bodies)],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(elements)},
                }
            ]
        }
    ).encode()
    return httpx.post(
        f"{url}/v2/models/{model}/infer",
        content=header + elements,
        headers={
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(header)),
        },
        timeout=60,
    )


def test_archives_answer_over_v2(server: Server, store: Path) -> None:
    """One BYTES input element per TorchServe request, handed to the handler as a raw body
    (binary or a JSON string alike); the answer's body as the BYTES output element."""
    image = DIGITS["7"]
    binary = _v2_binary(server.url, "mnist", [image])
    assert binary.status_code == 200, binary.text
    assert binary.json()["outputs"][0]["data"] == [str(mnist_reference(store, [image])[0])]
    text = {"inputs": [{"name": "body", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]}]}
    echoed = httpx.post(f"{server.url}/v2/models/lazy/infer", json=text)
    assert echoed.status_code == 200, echoed.text
    assert [json.loads(item)["echo"] for item in echoed.json()["outputs"][0]["data"]] == ["a", "b"]
    refused = httpx.post(f"{server.url}/v2/models/scale/infer", json=text)
    assert refused.status_code == 500
    assert refused.json()["error"] == (
        "the model's handler answered 513: send a JSON object with a list 'x' of 4 numbers"
    )


def _grpc_bodies(bodies: list[bytes], *, column: bool = False) -> triton.InferInput:
    """The BYTES input ``body``, shaped ``[n]`` or, as a column, ``[n, 1]``."""
    array = np.array(bodies, dtype=np.object_).reshape((-1, 1) if column else (-1,))
    tensor = triton.InferInput("body", list(array.shape), "BYTES")
    tensor.set_data_from_numpy(array)
    return tensor


def test_archives_answer_over_grpc_as_over_http(server: Server) -> None:
    """V2's ModelInfer over gRPC reaches an archive as V2 over HTTP does: each element of the
    BYTES input ``body`` one request, each answer's body an element of the BYTES output
    ``answer``, byte for byte what /predictions answers; a handler's failure is the call's,
    with the handler's message."""
    assert server.grpc_address is not None
    images = [DIGITS["7"], DIGITS["0"], DIGITS["1"]]
    predicted = [httpx.put(f"{server.url}/predictions/mnist", content=i).content for i in images]
    over_http = _v2_binary(server.url, "mnist", images)
    assert over_http.status_code == 200, over_http.text
    assert over_http.json()["outputs"][0]["data"] == [p.decode() for p in predicted]
    texts = [b'{"text": "a"}', b"plain"]
    echoed = _v2_binary(server.url, "lazy", texts)
    assert echoed.status_code == 200, echoed.text
    with triton.InferenceServerClient(server.grpc_address) as client:
        metadata = client.get_model_metadata("mnist", as_json=True)
        # One element a request: [n] or [n, 1] (Triton's scalar), as over HTTP.
        assert metadata["inputs"] == [{"name": "body", "datatype": "BYTES", "shape": ["-1", "1"]}]
        assert metadata["outputs"] == [{"name": "answer", "datatype": "BYTES", "shape": ["-1"]}]
        answer = client.infer("mnist", [_grpc_bodies(images)]).as_numpy("answer")
        assert answer is not None and answer.tolist() == predicted
        lazy = client.infer("lazy", [_grpc_bodies(texts, column=True)]).as_numpy("answer")
        assert lazy is not None
        assert [item.decode() for item in lazy.tolist()] == echoed.json()["outputs"][0]["data"]
        with pytest.raises(InferenceServerException) as refused:
            client.infer("scale", [_grpc_bodies([b"not json"])])
    assert refused.value.status() == str(grpc.StatusCode.INTERNAL)
    assert refused.value.message() == (
        "the model's handler answered 513: send a JSON object with a list 'x' of 4 numbers"
    )


def test_polled_repository_follows_archive_files(server: Server, store: Path) -> None:
    """Polling leaves unchanged archives serving; removing the .mar unloads its model and
    putting it back loads it again."""
    archive = store / "store" / "lazy.mar"
    kept = store / "lazy.mar.kept"
    shutil.move(archive, kept)
    try:
        _until(lambda: httpx.post(f"{server.url}/predictions/lazy", json={}).status_code == 404)
        assert httpx.post(f"{server.url}/predictions/scale", json={"x": [1, 2, 3, 4]}).is_success
    finally:
        shutil.move(kept, archive)
    _until(lambda: httpx.post(f"{server.url}/predictions/lazy", json={}).status_code == 200)


def test_changing_models_needs_model_control(server: Server) -> None:
    for refused in (
        httpx.post(f"{server.url}/models?url=scale.mar"),
        httpx.delete(f"{server.url}/models/scale"),
    ):
        assert refused.status_code == 405
        assert refused.json()["type"] == "MethodNotAllowedException"
        assert "NOGRAD_MODEL_CONTROL=explicit" in refused.json()["message"]
    assert (
        httpx.post(f"{server.url}/predictions/scale", json={"x": [0, 0, 0, 0]}).status_code == 200
    )


def test_memory_plan_caps_a_sampled_archive_batch(managed: Server) -> None:
    registered = httpx.post(f"{managed.url}/models?url=mnist.mar", headers=AUTH, timeout=60)
    assert registered.status_code == 200, registered.text
    described = httpx.get(f"{managed.url}/models/mnist", headers=AUTH).json()[0]
    assert described["batchSize"] == 8
    assert 1 <= described["nograd"]["batchLimit"] < 8, described["nograd"]
    answer = httpx.put(f"{managed.url}/predictions/mnist", content=DIGITS["7"], headers=AUTH)
    assert answer.status_code == 200, answer.text


ECHO_HANDLER = b"""
def handle(data, context):
    if not data:
        return None
    return [{"echo": row.get("body") or row.get("data")} for row in data]
"""


def _hand_built_archive(path: Path, name: str, **files: str) -> Path:
    """A ``.mar`` as torch-model-archiver lays one out, with a function handler and the
    manifest's file fields given (``configFile``...)."""
    manifest = {"model": {"modelName": name, "modelVersion": "1.0", "handler": "echo.py", **files}}
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest))
        archive.writestr("echo.py", ECHO_HANDLER)
    return path


def test_archives_unpack_at_load_and_go_at_unload(managed: Server, store: Path) -> None:
    """Listing an archive reads it in place; registering unpacks it once, held by each worker;
    unregistering removes the unpacked folder."""
    archive = _hand_built_archive(store / "managed" / "echo.mar", "echo")
    folder = store / "cache" / "torchserve" / hashlib.sha256(archive.read_bytes()).hexdigest()[:32]
    index = httpx.post(f"{managed.url}/v2/repository/index", headers=AUTH, timeout=30).json()
    assert {"name": "echo", "state": "UNAVAILABLE", "reason": "not loaded"} in [
        {k: row.get(k) for k in ("name", "state", "reason")} for row in index
    ]
    assert not folder.exists()
    registered = httpx.post(f"{managed.url}/models?url=echo.mar", headers=AUTH, timeout=60)
    assert registered.status_code == 200, registered.text
    assert (folder / "echo.py").is_file()
    assert len(list(folder.with_name(folder.name + ".holders").iterdir())) == 2
    answer = httpx.post(f"{managed.url}/predictions/echo", json={"hi": 1}, headers=AUTH)
    assert answer.status_code == 200 and answer.json() == {"echo": {"hi": 1}}, answer.text
    removed = httpx.delete(f"{managed.url}/models/echo", headers=AUTH, timeout=60)
    assert removed.status_code == 200, removed.text
    assert not folder.exists()
    archive.unlink()


@pytest.mark.parametrize(
    ("field", "named"),
    [("configFile", "../../../../../../etc/hostname"), ("serializedFile", "/etc/passwd")],
)
def test_register_refuses_an_archive_naming_files_outside_it(
    managed: Server, store: Path, field: str, named: str
) -> None:
    archive = _hand_built_archive(store / "managed" / "outside.mar", "outside", **{field: named})
    try:
        refused = httpx.post(f"{managed.url}/models?url=outside.mar", headers=AUTH, timeout=60)
    finally:
        archive.unlink()
    assert refused.status_code == 400
    body = refused.json()
    assert body["type"] == "InvalidModelException"
    assert f"'model.{field}' names " in body["message"]
    assert "outside the archive" in body["message"]
    # The archive is named as the client named it, not by the server's folder.
    assert body["message"].startswith("outside.mar: "), body["message"]
    assert str(store) not in body["message"]
