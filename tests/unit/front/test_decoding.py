"""What a front process decodes itself (a small, whole, plain V2 inference request) and what it
leaves to the engine as it came: anything compressed, large, chunked, in shared memory, or that
fails to decode, whose refusal is the engine's to answer."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from nograd.front.decoding import PREDECODED_BODY_BYTES, decodable, predecode
from nograd.protocol import binary
from nograd.protocol.limits import json_decoded_bytes
from nograd.protocol.v2 import decode_body

DOCUMENT = {
    "id": "r1",
    "parameters": {"timeout": 5000},
    "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
}
LIMIT = 1 << 20


def scope(path: str = "/v2/models/m/infer", method: str = "POST", **headers: str) -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()],
    }


def test_a_plain_inference_with_its_length_is_decodable() -> None:
    assert decodable(scope(content_length="10"))
    assert decodable(scope("/v2/models/m/versions/2/infer", content_length="10"))


@pytest.mark.parametrize(
    "call",
    [
        scope(method="GET", content_length="10"),
        scope("/v2/models/m/ready", content_length="10"),
        scope("/v1/embeddings", content_length="10"),
        scope(),  # chunked: no length
        scope(content_length="10", content_encoding="gzip"),
        scope(content_length=str(PREDECODED_BODY_BYTES + 1)),
        scope(content_length="-1"),
    ],
    ids=["get", "ready", "embeddings", "chunked", "compressed", "large", "bad-length"],
)
def test_other_calls_reach_the_engine_as_they_came(call: dict[str, Any]) -> None:
    assert not decodable(call)


def test_a_json_request_is_decoded_as_the_engine_would() -> None:
    body = orjson.dumps(DOCUMENT)
    predecoded = predecode(scope(), body, LIMIT)
    assert predecoded is not None
    expected = decode_body(body, None)
    assert predecoded.request.id == "r1"
    np.testing.assert_array_equal(predecoded.request.inputs["x"], expected.inputs["x"])
    assert predecoded.request.inputs["x"].dtype == np.float32
    assert predecoded.declared == {"x": ("FP32", (1, 4))}
    assert predecoded.parameters == {"timeout": 5000}
    assert predecoded.json_bytes == json_decoded_bytes(body, LIMIT)


def test_a_binary_input_is_decoded_from_the_body() -> None:
    array = np.arange(4, dtype=np.float32).reshape(1, 4)
    raw = binary.encode_tensor(array)
    inputs = [
        {"name": "x", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}}
    ]
    header = orjson.dumps({"inputs": inputs})
    call = scope(inference_header_content_length=str(len(header)))
    predecoded = predecode(call, header + bytes(raw), LIMIT)
    assert predecoded is not None
    np.testing.assert_array_equal(predecoded.request.inputs["x"], array)


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        orjson.dumps({"inputs": []}),
        orjson.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1]}]}),
        orjson.dumps(
            {
                "inputs": [
                    {
                        "name": "x",
                        "shape": [1],
                        "datatype": "FP32",
                        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4},
                    }
                ]
            }
        ),
        orjson.dumps(
            {
                **DOCUMENT,
                "outputs": [
                    {
                        "name": "y",
                        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4},
                    }
                ],
            }
        ),
    ],
    ids=["malformed", "no-inputs", "data-short-of-shape", "input-in-shm", "output-in-shm"],
)
def test_what_fails_to_decode_or_lives_in_shared_memory_is_the_engines(body: bytes) -> None:
    assert predecode(scope(), body, LIMIT) is None


def test_json_past_the_decoded_limit_is_the_engines_to_refuse() -> None:
    body = orjson.dumps(DOCUMENT)
    assert predecode(scope(), body, json_decoded_bytes(body, LIMIT) - 1) is None
