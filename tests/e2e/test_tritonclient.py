"""NVIDIA's own HTTP client (``tritonclient[http]``) against a running nograd, unchanged.

Health, server and model metadata, inference with JSON and with binary tensors (FP32 on digits,
BYTES texts on minilm) giving identical answers both ways, requested-output subsets, errors, and
the statistics extension.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.e2e.serving import ROOT

pytestmark = pytest.mark.e2e

SAMPLE = json.loads((ROOT / "models/digits/sample.json").read_text())["inputs"][0]
IMAGES = np.asarray(SAMPLE["data"], dtype=np.float32).reshape(SAMPLE["shape"])
TEXTS = ["A man is eating food.", "", "Ünïcödé 🙂 日本語", "word " * 300]


@pytest.fixture(scope="module")
def client(server_url: str) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(server_url.removeprefix("http://"), network_timeout=60)
    yield client
    client.close()


def _image_input(binary: bool) -> triton.InferInput:
    tensor = triton.InferInput("image", list(IMAGES.shape), "FP32")
    tensor.set_data_from_numpy(IMAGES, binary_data=binary)
    return tensor


def _text_input(texts: list[str], binary: bool) -> triton.InferInput:
    array = np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def _output(result: triton.InferResult, name: str) -> np.ndarray:
    array = result.as_numpy(name)
    assert array is not None, f"no output {name}"
    return array


def _is_binary(result: triton.InferResult, name: str) -> bool:
    output = result.get_output(name)
    assert output is not None
    return "binary_data_size" in (output.get("parameters") or {})


def test_liveness_readiness_and_server_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata["name"] == "nograd"
    assert {"binary_tensor_data", "statistics"} <= set(metadata["extensions"])


def test_model_metadata_and_readiness(client: triton.InferenceServerClient) -> None:
    for name in ("digits", "minilm"):
        assert client.is_model_ready(name)
        assert client.is_model_ready(name, "1")
    digits = client.get_model_metadata("digits")
    assert digits["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    minilm = client.get_model_metadata("minilm", "1")
    assert minilm["versions"] == ["1"]
    assert minilm["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1, 1]}]
    assert {"name": "embedding", "datatype": "FP32", "shape": [-1, 384]} in minilm["outputs"]
    assert not client.is_model_ready("nope")


def test_digits_json_and_binary_give_the_same_answers(
    client: triton.InferenceServerClient,
) -> None:
    names = ("logits", "probabilities", "label")
    as_json = client.infer(
        "digits",
        [_image_input(binary=False)],
        outputs=[triton.InferRequestedOutput(n, binary_data=False) for n in names],
    )
    as_binary = client.infer("digits", [_image_input(binary=True)])  # all outputs binary
    for name in names:
        assert not _is_binary(as_json, name)
        assert _is_binary(as_binary, name)
        json_array, binary_array = _output(as_json, name), _output(as_binary, name)
        assert json_array.shape == binary_array.shape
        # JSON carries float32 in shortest round-trip form: equal after the cast back.
        np.testing.assert_array_equal(json_array.astype(binary_array.dtype), binary_array)
    assert _output(as_binary, "label").dtype == np.int64
    assert _output(as_binary, "label").ravel().tolist() == [2, 1]


def test_requested_outputs_subset_binary_or_json_per_output(
    client: triton.InferenceServerClient,
) -> None:
    result = client.infer(
        "digits",
        [_image_input(binary=True)],
        outputs=[
            triton.InferRequestedOutput("label", binary_data=False),
            triton.InferRequestedOutput("probabilities", binary_data=True),
        ],
        request_id="req-7",
    )
    response = result.get_response()
    assert response["id"] == "req-7"
    assert [o["name"] for o in response["outputs"]] == ["label", "probabilities"]
    assert not _is_binary(result, "label")
    assert _is_binary(result, "probabilities")
    assert result.as_numpy("logits") is None
    np.testing.assert_allclose(_output(result, "probabilities").sum(axis=1), 1.0, rtol=1e-5)


def test_minilm_bytes_json_and_binary_give_the_same_embeddings(
    client: triton.InferenceServerClient,
) -> None:
    outputs = [triton.InferRequestedOutput("embedding", binary_data=False)]
    as_json = client.infer("minilm", [_text_input(TEXTS, binary=False)], outputs=outputs)
    as_binary = client.infer("minilm", [_text_input(TEXTS, binary=True)])
    json_vectors = _output(as_json, "embedding").astype(np.float32)
    binary_vectors = _output(as_binary, "embedding")
    assert binary_vectors.shape == (len(TEXTS), 384)
    assert binary_vectors.dtype == np.float32
    np.testing.assert_array_equal(json_vectors, binary_vectors)
    np.testing.assert_allclose(np.linalg.norm(binary_vectors, axis=1), 1.0, atol=1e-5)
    counts = _output(as_binary, "token_count").ravel().tolist()
    assert counts[1] == 2
    assert counts[3] == 256  # truncated
    # Batching and padding do not change a text's embedding.
    alone = client.infer("minilm", [_text_input(TEXTS[:1], binary=True)])
    np.testing.assert_allclose(_output(alone, "embedding")[0], binary_vectors[0], atol=1e-5)


def test_errors_are_raised_with_their_status(client: triton.InferenceServerClient) -> None:
    with pytest.raises(
        InferenceServerException, match="Request for unknown model: 'nope' is not found"
    ) as unknown:
        client.infer("nope", [_image_input(binary=True)])
    assert unknown.value.status() == "404"
    wrong = triton.InferInput("image", [1, 8, 8], "FP32")
    wrong.set_data_from_numpy(IMAGES[0], binary_data=True)
    with pytest.raises(InferenceServerException, match="shape") as bad:
        client.infer("digits", [wrong])
    assert bad.value.status() == "400"
    with pytest.raises(InferenceServerException, match="not produced") as missing:
        client.infer(
            "digits", [_image_input(True)], outputs=[triton.InferRequestedOutput("nothing")]
        )
    assert missing.value.status() == "400"


def test_per_request_timeout_parameter(client: triton.InferenceServerClient) -> None:
    # 1 µs passes before the request can reach a batch: refused as 504, never computed.
    with pytest.raises(InferenceServerException, match="deadline") as late:
        client.infer("minilm", [_text_input(["too late"], binary=True)], timeout=1)
    assert late.value.status() == "504"
    generous = client.infer("minilm", [_text_input(["in time"], binary=True)], timeout=60_000_000)
    assert _output(generous, "embedding").shape == (1, 384)
    with pytest.raises(InferenceServerException, match="timeout") as bad:
        client.infer("digits", [_image_input(True)], timeout=-5)
    assert bad.value.status() == "400"


def _stats(client: triton.InferenceServerClient, name: str) -> dict[str, Any]:
    stats: dict[str, Any] = client.get_inference_statistics(name)
    [model] = stats["model_stats"]
    assert model["name"] == name
    return model


def test_statistics_count_successes_failures_queue_and_batches(
    client: triton.InferenceServerClient,
) -> None:
    before = _stats(client, "minilm")
    client.infer("minilm", [_text_input(TEXTS[:2], binary=True)])
    client.infer("minilm", [_text_input(["one"], binary=False)])
    invalid = triton.InferInput("text", [1], "BYTES")
    invalid.set_data_from_numpy(np.array([b"\xff\xfe"], dtype=np.object_), binary_data=True)
    with pytest.raises(InferenceServerException, match="UTF-8"):
        client.infer("minilm", [invalid])
    after = _stats(client, "minilm")

    stats, old = after["inference_stats"], before["inference_stats"]
    assert stats["success"]["count"] - old["success"]["count"] == 2
    assert stats["success"]["ns"] > old["success"]["ns"]
    assert stats["fail"]["count"] - old["fail"]["count"] == 1
    assert stats["queue"]["count"] - old["queue"]["count"] == 2
    assert stats["compute_infer"]["count"] - old["compute_infer"]["count"] == 2
    assert stats["compute_infer"]["ns"] > old["compute_infer"]["ns"]
    assert after["inference_count"] - before["inference_count"] == 3
    assert after["execution_count"] - before["execution_count"] == 2
    assert after["last_inference"] >= before["last_inference"]
    assert after["last_inference"] > 0
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    assert sizes.get(1, 0) >= 1 and sizes.get(2, 0) >= 1
    assert after["version"] == "1"


def test_statistics_of_every_model_and_of_unknown_ones(
    client: triton.InferenceServerClient, server_url: str
) -> None:
    everything = client.get_inference_statistics()
    assert {m["name"] for m in everything["model_stats"]} == {"digits", "minilm"}
    assert client.get_inference_statistics("digits", "1")["model_stats"][0]["version"] == "1"
    with pytest.raises(InferenceServerException) as unknown:
        client.get_inference_statistics("nope")
    assert unknown.value.status() == "404"
    reply = httpx.get(f"{server_url}/v2/models/digits/versions/9/stats")
    assert reply.status_code == 404
    assert "error" in reply.json()


# ---------------------------------------------------------------------------- raw HTTP, malformed
def _raw_infer(server_url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{server_url}/v2/models/digits/infer", content=body, headers=headers)


def test_response_framing_for_binary_outputs(server_url: str) -> None:
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": list(IMAGES.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": IMAGES.nbytes},
                }
            ],
            "outputs": [{"name": "label", "parameters": {"binary_data": True}}],
        }
    )
    reply = _raw_infer(
        server_url,
        header + IMAGES.tobytes(),
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == "application/octet-stream"
    length = int(reply.headers["inference-header-content-length"])
    document = orjson.loads(reply.content[:length])
    [label] = document["outputs"]
    assert label["parameters"]["binary_data_size"] == 16
    assert "data" not in label
    assert np.frombuffer(reply.content[length:], dtype="<i8").tolist() == [2, 1]


@pytest.mark.parametrize(
    ("length", "trim", "message"),
    [
        ("nonsense", 0, "must be a non-negative integer"),
        ("100000", 0, "body has only"),
        (None, -4, "binary_data_size is 256 but only 252 bytes"),
        (None, 4, "4 bytes of binary data follow the last binary input"),
    ],
)
def test_malformed_binary_requests_are_400(
    server_url: str, length: str | None, trim: int, message: str
) -> None:
    """``trim`` < 0 cuts bytes off the tensor, > 0 appends stray bytes after it."""
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": [1, 1, 8, 8],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 256},
                }
            ]
        }
    )
    raw = IMAGES[:1].tobytes()
    payload = raw[:trim] if trim < 0 else raw + b"\x00" * trim
    headers = {"Inference-Header-Content-Length": length or str(len(header))}
    reply = _raw_infer(server_url, header + payload, headers)
    assert reply.status_code == 400
    assert message in reply.json()["error"]


def test_model_configuration_in_triton_s_shape(client: triton.InferenceServerClient) -> None:
    digits = client.get_model_config("digits")
    assert digits["name"] == "digits"
    assert digits["max_batch_size"] >= 64
    image = digits["input"][0]
    assert (image["name"], image["data_type"], image["dims"]) == ("image", "TYPE_FP32", [1, 8, 8])
    assert [o["name"] for o in digits["output"]] == ["logits", "probabilities", "label"]
    assert digits["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert client.get_model_config("digits", "1") == digits
    minilm = client.get_model_config("minilm")
    text = minilm["input"][0]
    assert (text["data_type"], text["dims"], text["reshape"]) == ("TYPE_STRING", [1], {"shape": []})
    assert minilm["parameters"]["batch_unit"] == {"string_value": "tokens"}
    with pytest.raises(InferenceServerException, match="Request for unknown model"):
        client.get_model_config("nope")


def test_repository_index_and_model_control(client: triton.InferenceServerClient) -> None:
    index = client.get_model_repository_index()
    assert {(m["name"], m["version"], m["state"]) for m in index} == {
        ("digits", "1", "READY"),
        ("minilm", "1", "READY"),
    }
    for control in (client.load_model, client.unload_model):
        with pytest.raises(InferenceServerException, match="model control is not enabled"):
            control("digits")
    assert client.is_model_ready("digits")
