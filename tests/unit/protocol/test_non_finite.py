"""NaN and +/-Inf on the V2 wire: JSON cannot carry them, so a JSON request holding them is a 400
that says why; a JSON output holding them is sent as null, marked, and warned about (rate-limited);
binary tensors carry them as they are."""

from __future__ import annotations

import logging

import numpy as np
import orjson
import pytest

from nograd.core.errors import DecodeError
from nograd.protocol import binary
from nograd.protocol import v2 as codec
from nograd.protocol.v2 import (
    NON_FINITE_PARAMETER,
    RequestedOutput,
    decode_body,
    dumps,
    encode_outputs,
    encode_tensor,
    parse_json,
)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "_non_finite_warnings", codec._NonFiniteWarnings())


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "nan", "1e999", "-1e999"])
def test_a_non_finite_json_number_is_refused_with_the_reason(token: str) -> None:
    body = f'{{"inputs": [{{"name": "x", "data": [1.0, {token}]}}]}}'.encode()
    with pytest.raises(DecodeError, match=r"malformed JSON: .*JSON has no NaN or Infinity"):
        parse_json(body)


def test_other_malformed_json_gets_no_non_finite_hint() -> None:
    with pytest.raises(DecodeError) as refused:
        parse_json(b'{"inputs": [1, 2,]}')
    assert "NaN" not in str(refused.value)


def test_binary_tensor_data_carries_non_finite_inputs_as_they_are() -> None:
    values = np.array([np.nan, np.inf, -np.inf, 1.5], dtype=np.float32)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [1, 4],
                    "parameters": {binary.SIZE_PARAMETER: values.nbytes},
                }
            ]
        }
    )
    request = decode_body(header + values.tobytes(), str(len(header)))
    decoded = request.inputs["x"].reshape(-1)
    assert np.isnan(decoded[0]) and decoded[1] == np.inf and decoded[2] == -np.inf
    assert decoded[3] == 1.5


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_a_json_output_with_non_finite_values_is_null_and_marked(dtype: type) -> None:
    array = np.array([[1.0, np.nan], [np.inf, -np.inf]], dtype=dtype)
    encoded = orjson.loads(dumps(encode_tensor("y", array)))
    assert encoded["data"] == [1.0, None, None, None]
    assert encoded["parameters"] == {NON_FINITE_PARAMETER: "null"}


def test_finite_and_non_float_outputs_are_not_marked() -> None:
    assert "parameters" not in encode_tensor("y", np.array([1.0, 2.0], dtype=np.float32))
    assert "parameters" not in encode_tensor("n", np.array([1, 2], dtype=np.int64))
    assert "parameters" not in encode_tensor("t", np.array([b"nan"], dtype=object))


def test_a_binary_output_carries_non_finite_values_exactly_and_unmarked() -> None:
    array = np.array([np.nan, np.inf, -np.inf], dtype=np.float32)
    tensors, chunks = encode_outputs({"y": array}, [RequestedOutput("y", binary=True)])
    assert tensors[0]["parameters"] == {binary.SIZE_PARAMETER: array.nbytes}
    assert bytes(chunks[0]) == array.tobytes()


def test_the_warning_names_model_and_outputs_once_per_interval(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = {
        "y": np.array([np.nan], dtype=np.float32),
        "z": np.array([1.0], dtype=np.float32),
    }
    selected = [RequestedOutput("y"), RequestedOutput("z")]
    now = [1000.0]
    monkeypatch.setattr(codec.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.WARNING, logger=codec.logger.name):
        for _ in range(3):
            encode_outputs(outputs, selected, model="m")
        encode_outputs(outputs, selected, model="other")
        encode_outputs({"z": outputs["z"]}, [RequestedOutput("z")], model="quiet")
        now[0] += codec.NON_FINITE_WARNING_INTERVAL_S
        encode_outputs(outputs, selected, model="m")
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 3
    assert messages[0].startswith("model 'm': output(s) ['y'] held NaN or +/-Inf")
    assert "(1 response(s) since" in messages[0]
    assert messages[1].startswith("model 'other':")
    assert messages[2].startswith("model 'm':") and "(3 response(s) since" in messages[2]
