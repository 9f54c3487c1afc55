"""The paths nograd reads itself, and the OpenAI error body every /v1 error shares."""

from __future__ import annotations

import orjson

from nograd.http.error_bodies import openai_error_body
from nograd.http.middleware import model_label
from nograd.http.paths import infer_target, route_path, v2_model
from nograd.observability.metrics import UNKNOWN_MODEL


def test_inference_paths_name_the_model_and_version() -> None:
    assert infer_target("/v2/models/digits/infer") == ("digits", None)
    assert infer_target("/v2/models/digits/versions/1/infer") == ("digits", "1")
    assert infer_target("/v2/models/digits/ready") is None
    assert infer_target("/v2/models/digits/infer/more") is None
    assert infer_target("/v2/health/ready") is None
    assert v2_model("/v2/models/digits/versions/2/stats") == ("digits", "2", "/stats")
    assert v2_model("/v2/models/digits") == ("digits", None, "")


def test_metric_labels_name_only_known_models() -> None:
    def known(name: str) -> bool:
        return name == "digits"

    assert model_label("/v2/models/digits/versions/1/infer", known) == "digits"
    assert model_label("/v2/models/other/infer", known) == UNKNOWN_MODEL
    assert model_label("/v1/embeddings", known) == UNKNOWN_MODEL


def test_the_router_path_drops_a_proxy_prefix() -> None:
    assert route_path({"path": "/ml/v2/models/m/infer", "root_path": "/ml"}) == "/v2/models/m/infer"
    assert route_path({"path": "/v1/embeddings"}) == "/v1/embeddings"


def test_openai_errors_have_the_sdk_shape() -> None:
    auth = orjson.loads(openai_error_body(401, "missing API key", code="invalid_api_key"))
    assert auth == {
        "error": {
            "message": "missing API key",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    missing = orjson.loads(openai_error_body(404, "no such model", param="model"))["error"]
    assert missing["type"] == "invalid_request_error" and missing["code"] == "model_not_found"
    assert missing["param"] == "model"
    assert orjson.loads(openai_error_body(503, "busy"))["error"]["type"] == "server_error"
