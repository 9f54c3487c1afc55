"""The binary tensor data extension codec (``nograd/protocol/binary.py``) and its use in
``v2_codec``.

Round trips for every datatype, tritonclient's own serialisation on both sides (its request
builder feeds our decoder, its response parser reads our encoder), and every malformed body a
client can send is a ``DecodeError`` (400) naming the problem.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as triton
from tritonclient.utils import serialize_byte_tensor

from nograd.core.datatypes import NUMPY_DTYPES, datatype_of
from nograd.core.errors import DecodeError
from nograd.protocol import binary
from nograd.protocol.v2 import (
    RequestedOutput,
    decode_body,
    dumps,
    encode_outputs,
    select_outputs,
)

FIXED = [name for name in NUMPY_DTYPES if name != "BYTES"]


def _sample(datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    generator = np.random.default_rng(7)
    if datatype == "BYTES":
        values = [b"", b"a", "\u00fcnic\u00f6de".encode(), b"\x00\xff raw", b"x" * 300]
        flat = np.empty(int(np.prod(shape)), dtype=np.object_)
        flat[:] = [values[i % len(values)] for i in range(flat.size)]
        return flat.reshape(shape)
    if datatype == "BOOL":
        return generator.integers(0, 2, size=shape).astype(np.bool_)
    dtype = NUMPY_DTYPES[datatype]
    if dtype.kind in "iu":
        info = np.iinfo(dtype.type)
        return generator.integers(info.min, info.max, size=shape, dtype=dtype.type, endpoint=True)
    return (generator.standard_normal(size=shape) * 1e3).astype(dtype)


def _body(inputs: list[dict[str, Any]], chunks: list[bytes], **extra: Any) -> tuple[bytes, str]:
    header = orjson.dumps({"inputs": inputs, **extra})
    return header + b"".join(chunks), str(len(header))


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("datatype", [*FIXED, "BYTES"])
@pytest.mark.parametrize("shape", [(3,), (2, 3, 4), (0, 5), ()])
def test_round_trip_every_datatype(datatype: str, shape: tuple[int, ...]) -> None:
    array = _sample(datatype, shape)
    raw = bytes(binary.encode_tensor(array))
    decoded = binary.decode_tensor(raw, datatype, shape, "t")
    assert decoded.shape == shape
    assert decoded.dtype == array.dtype
    assert np.array_equal(decoded, array)


@pytest.mark.parametrize("datatype", FIXED)
def test_wire_format_is_little_endian_row_major(datatype: str) -> None:
    array = _sample(datatype, (2, 3))
    expected = np.ascontiguousarray(array).astype(binary.little_endian(datatype)).tobytes()
    assert bytes(binary.encode_tensor(array)) == expected
    # A transposed (non-contiguous) view is sent in its logical row-major order.
    assert bytes(binary.encode_tensor(array.T)) == np.ascontiguousarray(array.T).tobytes()


def test_bool_is_one_byte_per_element() -> None:
    assert bytes(binary.encode_tensor(np.array([True, False, True]))) == b"\x01\x00\x01"


def test_bytes_elements_are_length_prefixed() -> None:
    array = np.array([b"ab", b"", "\u00e9".encode()], dtype=np.object_)
    assert (
        bytes(binary.encode_tensor(array))
        == b"\x02\x00\x00\x00ab\x00\x00\x00\x00\x02\x00\x00\x00\xc3\xa9"
    )
    # Python str elements are sent as UTF-8.
    assert (
        binary.encode_tensor(np.array(["\u00e9"], dtype=np.object_)) == b"\x02\x00\x00\x00\xc3\xa9"
    )


def test_bytes_match_tritonclient_serialisation() -> None:
    array = _sample("BYTES", (2, 5))
    ours = bytes(binary.encode_tensor(array))
    assert ours == serialize_byte_tensor(array).item()


def test_fixed_size_inputs_are_writable_views_of_one_buffer() -> None:
    image = _sample("FP32", (2, 3))
    label = _sample("INT64", (2,))
    body, length = _body(
        [
            _binary_input("image", image),
            _binary_input("label", label),
        ],
        [image.tobytes(), label.tobytes()],
    )
    request = decode_body(body, length)
    decoded = request.inputs["image"]
    assert np.array_equal(decoded, image)
    assert np.array_equal(request.inputs["label"], label)
    # A view (no per-tensor copy) that torch.from_numpy accepts without a read-only warning.
    assert decoded.base is not None
    assert decoded.flags.writeable
    # Both views sit back to back in the one copy of the binary part.
    assert request.inputs["label"].ctypes.data - decoded.ctypes.data == image.nbytes


def _binary_input(name: str, array: np.ndarray, datatype: str | None = None) -> dict[str, Any]:
    raw = binary.encode_tensor(array)
    return {
        "name": name,
        "shape": list(array.shape),
        "datatype": datatype or datatype_of(array),
        "parameters": {"binary_data_size": len(raw)},
    }


def test_json_and_binary_inputs_mix_in_one_request() -> None:
    texts = _sample("BYTES", (3,))
    raw = bytes(binary.encode_tensor(texts))
    body, length = _body(
        [
            {"name": "a", "shape": [2], "datatype": "INT32", "data": [1, 2]},
            _binary_input("texts", texts),
            {"name": "b", "shape": [1], "datatype": "BOOL", "data": [True]},
        ],
        [raw],
    )
    request = decode_body(body, length)
    assert request.inputs["a"].tolist() == [1, 2]
    assert request.inputs["texts"].tolist() == texts.tolist()
    assert request.inputs["b"].tolist() == [True]


def test_without_the_header_the_whole_body_is_json() -> None:
    body = orjson.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
    assert decode_body(body, None).inputs["x"].tolist() == [1.0]


# ---------------------------------------------------------------------------- tritonclient interop
def test_decodes_tritonclient_request_bodies() -> None:
    image = _sample("FP32", (2, 1, 8, 8))
    texts = _sample("BYTES", (4,))
    flags = _sample("BOOL", (2, 2))
    tensors = []
    for name, array, datatype, as_binary in (
        ("image", image, "FP32", True),
        ("texts", texts, "BYTES", True),
        ("flags", flags, "BOOL", False),
    ):
        tensor = triton.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=as_binary)
        tensors.append(tensor)
    outputs = [
        triton.InferRequestedOutput("y", binary_data=True),
        triton.InferRequestedOutput("z", binary_data=False),
    ]
    body, length = triton.InferenceServerClient.generate_request_body(
        tensors, outputs=outputs, request_id="r1"
    )
    request = decode_body(body, None if length is None else str(length))
    assert request.id == "r1"
    assert np.array_equal(request.inputs["image"], image)
    assert request.inputs["texts"].tolist() == texts.tolist()
    assert np.array_equal(request.inputs["flags"], flags)
    assert request.outputs == (RequestedOutput("y", True), RequestedOutput("z", False))


def test_tritonclient_without_outputs_asks_every_output_in_binary() -> None:
    tensor = triton.InferInput("x", [1], "FP32")
    tensor.set_data_from_numpy(np.ones(1, np.float32), binary_data=False)
    body, length = triton.InferenceServerClient.generate_request_body([tensor])
    request = decode_body(body, None if length is None else str(length))
    selected = select_outputs(["a", "b"], request.outputs, request.parameters)
    assert selected == [RequestedOutput("a", True), RequestedOutput("b", True)]
    # Each call gets its own list, whichever shared values fill it.
    selected.clear()
    assert select_outputs(["a", "b"], (), {"binary_data_output": True}) == [
        RequestedOutput("a", True),
        RequestedOutput("b", True),
    ]
    assert select_outputs(["a", "b"], ()) == [RequestedOutput("a"), RequestedOutput("b")]


@pytest.mark.parametrize("datatype", [*FIXED, "BYTES"])
def test_tritonclient_parses_our_responses(datatype: str) -> None:
    binary_out = _sample(datatype, (2, 3))
    json_out = _sample("FP32", (2,))
    tensors, chunks = encode_outputs(
        {"b": binary_out, "j": json_out},
        [RequestedOutput("b", binary=True), RequestedOutput("j", binary=False)],
    )
    header = dumps({"model_name": "m", "outputs": tensors})
    result = triton.InferenceServerClient.parse_response_body(
        binary.join_body(header, chunks), header_length=len(header)
    )
    parsed = result.as_numpy("b")
    assert parsed is not None
    if datatype == "BYTES":
        assert parsed.reshape(2, 3).tolist() == binary_out.tolist()
    else:
        assert np.array_equal(parsed.reshape(2, 3), binary_out)
    assert np.array_equal(result.as_numpy("j"), json_out)
    assert result.get_output("b")["parameters"]["binary_data_size"] == len(bytes(chunks[0]))
    assert "data" not in result.get_output("b")


def test_requested_subset_keeps_its_order_and_formats() -> None:
    selected = select_outputs(
        ["a", "b", "c"],
        (RequestedOutput("c", True), RequestedOutput("a", False)),
        {"binary_data_output": True},
    )
    assert selected == [RequestedOutput("c", True), RequestedOutput("a", False)]
    with pytest.raises(DecodeError, match="not produced"):
        select_outputs(["a"], (RequestedOutput("zz"),))


def test_binary_data_output_is_the_default_for_listed_outputs_too() -> None:
    body = orjson.dumps(
        {
            "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
            "outputs": [{"name": "a"}, {"name": "b", "parameters": {"binary_data": False}}],
            "parameters": {"binary_data_output": True},
        }
    )
    assert decode_body(body, None).outputs == (RequestedOutput("a", True), RequestedOutput("b"))


# ---------------------------------------------------------------------------- malformed bodies
@pytest.mark.parametrize("length", ["abc", "-1", "1.5", "", " "])
def test_malformed_header_length(length: str) -> None:
    with pytest.raises(DecodeError, match="Inference-Header-Content-Length"):
        decode_body(b'{"inputs": []}', length)


def test_header_length_beyond_the_body() -> None:
    with pytest.raises(DecodeError, match="body has only 14 bytes"):
        decode_body(b'{"inputs": []}', "15")


def test_header_length_cutting_the_json() -> None:
    with pytest.raises(DecodeError, match="malformed JSON"):
        decode_body(b'{"inputs": []}', "5")


def test_size_larger_than_the_binary_part() -> None:
    array = _sample("FP32", (4,))
    body, length = _body([_binary_input("x", array)], [array.tobytes()[:-4]])
    with pytest.raises(DecodeError, match="binary_data_size is 16 but only 12 bytes"):
        decode_body(body, length)


def test_size_not_matching_the_shape() -> None:
    array = _sample("FP32", (4,))
    spec = {**_binary_input("x", array), "shape": [5]}
    body, length = _body([spec], [array.tobytes()])
    with pytest.raises(DecodeError, match=r"shape \[5\] of FP32 needs 20 bytes"):
        decode_body(body, length)


def test_trailing_bytes_after_the_last_input() -> None:
    array = _sample("INT64", (2,))
    body, length = _body([_binary_input("x", array)], [array.tobytes(), b"\x00" * 3])
    with pytest.raises(DecodeError, match="3 bytes of binary data follow"):
        decode_body(body, length)


@pytest.mark.parametrize("size", [-1, "8", 1.5, True, None])
def test_binary_data_size_must_be_a_non_negative_integer(size: object) -> None:
    spec = {"name": "x", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": size}}
    body, length = _body([spec], [b"\x00" * 8])
    if size is None:  # no size: a JSON tensor without data
        with pytest.raises(DecodeError, match="'data' is missing"):
            decode_body(body, length)
        return
    with pytest.raises(DecodeError, match="binary_data_size must be a non-negative integer"):
        decode_body(body, length)


def test_binary_size_without_the_header() -> None:
    spec = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    with pytest.raises(DecodeError, match="no binary part"):
        decode_body(orjson.dumps({"inputs": [spec]}), None)


def test_data_and_binary_size_together() -> None:
    spec = {
        "name": "x",
        "shape": [1],
        "datatype": "FP32",
        "data": [1.0],
        "parameters": {"binary_data_size": 4},
    }
    body, length = _body([spec], [b"\x00" * 4])
    with pytest.raises(DecodeError, match="both 'data' and binary_data_size"):
        decode_body(body, length)


def test_bool_bytes_must_be_zero_or_one() -> None:
    spec = {"name": "x", "shape": [2], "datatype": "BOOL", "parameters": {"binary_data_size": 2}}
    body, length = _body([spec], [b"\x01\x02"])
    with pytest.raises(DecodeError, match="BOOL bytes must be 0 or 1"):
        decode_body(body, length)


@pytest.mark.parametrize(
    ("raw", "shape", "message"),
    [
        (struct.pack("<I", 5) + b"abc", (1,), "claims 5 bytes, only 3 remain"),
        (struct.pack("<I", 4) + b"abcd", (2,), "ends after 1 of 2 elements"),
        (struct.pack("<I", 1) + b"a", (2,), "2 BYTES elements need at least 8 bytes"),
        (struct.pack("<I", 1) + b"ab", (1,), "1 bytes left after the 1 BYTES elements"),
        (b"\x01\x00", (1,), "1 BYTES elements need at least 4 bytes"),
        (b"", (2**40,), "need at least 4398046511104 bytes"),
    ],
)
def test_malformed_bytes_elements(raw: bytes, shape: tuple[int, ...], message: str) -> None:
    spec = {
        "name": "t",
        "shape": list(shape),
        "datatype": "BYTES",
        "parameters": {"binary_data_size": len(raw)},
    }
    body, length = _body([spec], [raw])
    with pytest.raises(DecodeError, match=message):
        decode_body(body, length)


def test_a_classification_output_is_decoded_with_its_class_count() -> None:
    def body(count: object) -> bytes:
        return orjson.dumps(
            {
                "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
                "outputs": [{"name": "a", "parameters": {"classification": count}}],
            }
        )

    assert decode_body(body(3), None).outputs[0].classification == 3
    with pytest.raises(DecodeError, match="'classification' must be a positive integer"):
        decode_body(body("3"), None)


@pytest.mark.parametrize("shape", [[161, 0, 59501478496280752, 525], [0] * 33, [0, 2**62]])
def test_shapes_numpy_cannot_describe_are_400(shape: list[int]) -> None:
    """Found by the schema fuzzer: an empty tensor with huge other dimensions crashed numpy."""
    for size, chunks in ((None, []), (0, [b""])):
        spec: dict[str, Any] = {"name": "x", "shape": shape, "datatype": "FP32"}
        if size is None:
            spec["data"] = []
        else:
            spec["parameters"] = {"binary_data_size": size}
        body, length = _body([spec], chunks)
        with pytest.raises(DecodeError, match="is too large"):
            decode_body(body, length)
