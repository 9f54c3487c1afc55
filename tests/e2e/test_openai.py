"""The official ``openai`` SDK against a running nograd: embeddings, models, errors, metrics.

The SDK asks for base64 unless told otherwise and decodes it itself, so both encodings are
exercised; either way the vectors equal what the V2 route returns for the same texts.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.e2e

TEXTS = ["A man is eating food.", "", "Ünïcödé 🙂 日本語", "word " * 300]


@pytest.fixture(scope="module")
def client(server_url: str) -> Iterator[OpenAI]:
    # No retries: a 5xx must fail the test, not be retried into a pass.
    with OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def _v2_embeddings(server_url: str, texts: list[str]) -> np.ndarray:
    reply = httpx.post(
        f"{server_url}/v2/models/minilm/infer",
        json={
            "inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}],
            "outputs": [{"name": "embedding"}],
        },
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    [output] = reply.json()["outputs"]
    return np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])


def test_single_string(client: OpenAI, server_url: str) -> None:
    response = client.embeddings.create(model="minilm", input="A man is eating food.")
    assert response.object == "list"
    assert response.model == "minilm"
    [item] = response.data
    assert (item.object, item.index) == ("embedding", 0)
    assert len(item.embedding) == 384
    assert abs(np.linalg.norm(item.embedding) - 1.0) < 1e-5
    # [CLS] a man is eating food . [SEP]
    assert response.usage.prompt_tokens == response.usage.total_tokens == 8


def test_list_equals_v2_in_both_encodings(client: OpenAI, server_url: str) -> None:
    expected = _v2_embeddings(server_url, TEXTS)
    as_float = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.create(model="minilm", input=TEXTS)  # SDK default: base64
    for response in (as_float, as_base64):
        assert [d.index for d in response.data] == list(range(len(TEXTS)))
        vectors = np.asarray([d.embedding for d in response.data], dtype=np.float32)
        np.testing.assert_array_equal(vectors, expected)
    # Both responses count the same tokens; the truncated text counts 256.
    assert as_float.usage.prompt_tokens == as_base64.usage.prompt_tokens > 256


def test_base64_is_little_endian_float32(server_url: str) -> None:
    reply = httpx.post(
        f"{server_url}/v1/embeddings",
        json={"model": "minilm", "input": ["hello"], "encoding_format": "base64"},
        timeout=60,
    )
    assert reply.status_code == 200
    encoded = reply.json()["data"][0]["embedding"]
    vector = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    np.testing.assert_array_equal(vector, _v2_embeddings(server_url, ["hello"])[0])


def test_native_dimensions_and_user_are_accepted(client: OpenAI) -> None:
    response = client.embeddings.create(model="minilm", input="x", dimensions=384, user="u1")
    assert len(response.data[0].embedding) == 384


def test_models_list_and_retrieve(client: OpenAI) -> None:
    assert {m.id for m in client.models.list()} == {"digits", "minilm"}
    model = client.models.retrieve("minilm")
    assert (model.id, model.object, model.owned_by) == ("minilm", "model", "nograd")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_unknown_model_is_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="nope", input="x")
    assert caught.value.code == "model_not_found"
    assert caught.value.param == "model"
    assert "nope" in caught.value.message


@pytest.mark.parametrize(
    ("arguments", "param", "message"),
    [
        ({"model": "digits", "input": "x"}, "model", "not an embeddings model"),
        ({"model": "minilm", "input": "x", "dimensions": 128}, "dimensions", "dimensions=128"),
        ({"model": "minilm", "input": [101, 102]}, "input", "token-id input is not supported"),
        ({"model": "minilm", "input": [[101, 102]]}, "input", "token-id input is not supported"),
        ({"model": "minilm", "input": []}, "input", "must not be an empty list"),
        ({"model": "minilm", "input": ["x"] * 2049}, "input", "at most 2048"),
    ],
)
def test_bad_requests_are_bad_request_errors(
    client: OpenAI, arguments: dict[str, object], param: str, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(**arguments)
    assert caught.value.param == param
    assert caught.value.type == "invalid_request_error"
    assert message in caught.value.message


@pytest.mark.parametrize(
    "body",
    [b"{", b'{"input": "x"}', b'{"model": "minilm", "input": "x", "encoding_format": "hex"}'],
)
def test_malformed_bodies_get_the_openai_error_shape(server_url: str, body: bytes) -> None:
    reply = httpx.post(f"{server_url}/v1/embeddings", content=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"


def test_requests_are_counted_with_protocol_openai(client: OpenAI, server_url: str) -> None:
    def count(code: str, model: str) -> float:
        text = httpx.get(f"{server_url}/metrics").text
        for family in text_string_to_metric_families(text):
            if family.name == "nograd_requests":
                for sample in family.samples:
                    labels = sample.labels
                    if (labels["protocol"], labels["code"], labels["model"]) == (
                        "openai",
                        code,
                        model,
                    ):
                        return sample.value
        return 0.0

    ok, unknown = count("200", "minilm"), count("404", "_unknown")
    client.embeddings.create(model="minilm", input="counted")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="not-served", input="x")
    assert count("200", "minilm") == ok + 1
    assert count("404", "_unknown") == unknown + 1
