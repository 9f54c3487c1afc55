"""V2 JSON tensor decoding: strict about datatype, shape and range; exact on the way out."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from nograd.core.errors import DecodeError
from nograd.protocol.v2 import (
    RequestedOutput,
    decode_request,
    dumps,
    encode_tensor,
    parse_json,
    select_outputs,
)


def request(datatype: str, shape: list[int], data: object) -> dict[str, object]:
    return {"inputs": [{"name": "x", "datatype": datatype, "shape": shape, "data": data}]}


@pytest.mark.parametrize(
    ("datatype", "data", "dtype"),
    [
        ("BOOL", [True, False], np.bool_),
        ("UINT8", [0, 255], np.uint8),
        ("INT8", [-128, 127], np.int8),
        ("INT32", [1, -2], np.int32),
        ("INT64", [2**40, -1], np.int64),
        ("FP16", [0.5, 1], np.float16),
        ("FP32", [0.25, -3], np.float32),
        ("FP64", [1e300, 2], np.float64),
    ],
)
def test_datatypes_decode_to_numpy(datatype: str, data: list[object], dtype: type) -> None:
    decoded = decode_request(request(datatype, [2], data)).inputs["x"]
    assert decoded.dtype == np.dtype(dtype)
    assert decoded.tolist() == [dtype(v).item() for v in data]  # type: ignore[call-arg]


def test_nested_data_and_bytes() -> None:
    nested = decode_request(request("FP32", [2, 2], [[1, 2], [3, 4]])).inputs["x"]
    assert nested.shape == (2, 2) and nested[1, 0] == 3
    texts = decode_request(request("BYTES", [2], ["héllo", "b"])).inputs["x"]
    assert texts.dtype == object and texts[0] == "héllo".encode()


@pytest.mark.parametrize(
    ("datatype", "shape", "data", "fragment"),
    [
        ("INT8", [1], [300], "out of range"),
        ("UINT8", [1], [-1], "out of range"),
        ("INT32", [1], [1.5], "fractional"),
        ("FP32", [1], ["1.0"], "string"),
        ("FP32", [1], [None], "mixed or null"),
        ("FP16", [1], [1e10], "out of range"),
        ("BOOL", [1], [1], "not BOOL"),
        ("FP32", [2, 2], [[1, 2], [3]], "regular array"),
        ("FP32", [3], [1, 2], "needs 3 elements"),
        ("BYTES", [1], [1], "must be strings"),
    ],
)
def test_bad_tensors_are_named(
    datatype: str, shape: list[int], data: object, fragment: str
) -> None:
    with pytest.raises(DecodeError, match=fragment):
        decode_request(request(datatype, shape, data))


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ({}, "inputs"),
        ({"inputs": "x"}, "inputs"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": []}]}, "shape"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}, "data"),
        ({"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}, "name"),
        ({**request("FP32", [1], [1]), "id": 5}, "'id'"),
        ({**request("FP32", [1], [1]), "outputs": [{"nom": "y"}]}, "outputs"),
    ],
)
def test_bad_documents(document: object, fragment: str) -> None:
    with pytest.raises(DecodeError, match=fragment):
        decode_request(document)


def test_duplicate_input_names_are_refused() -> None:
    doc = request("FP32", [1], [1])
    doc["inputs"] = doc["inputs"] * 2  # type: ignore[operator]
    with pytest.raises(DecodeError, match="twice"):
        decode_request(doc)


def test_malformed_json() -> None:
    with pytest.raises(DecodeError, match="malformed JSON"):
        parse_json(b"{")


def test_output_selection_and_encoding() -> None:
    assert [o.name for o in select_outputs(["a", "b"], [])] == ["a", "b"]
    assert select_outputs(["a", "b"], [RequestedOutput("b")]) == [RequestedOutput("b")]
    with pytest.raises(DecodeError, match="not produced"):
        select_outputs(["a"], [RequestedOutput("z")])
    encoded = orjson.loads(dumps(encode_tensor("y", np.arange(6, dtype=np.float16).reshape(2, 3))))
    assert encoded == {"name": "y", "datatype": "FP16", "shape": [2, 3], "data": [0, 1, 2, 3, 4, 5]}
    texts = orjson.loads(dumps(encode_tensor("t", np.array([b"a", b"b"], dtype=object))))
    assert texts["datatype"] == "BYTES" and texts["data"] == ["a", "b"]
