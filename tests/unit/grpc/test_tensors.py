"""ModelInfer's inputs checked before any array is built: shapes numpy cannot describe, contents
that do not hold what the shape needs, typed values out of their datatype's range, and requests
over the model's limits refused from their headers alone, whatever their data holds."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nograd.core.errors import DecodeError
from nograd.grpc import tensors
from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.grpc.tensors import check_inputs, decode_inputs, read_inputs
from nograd.protocol.limits import MAX_DIMS, OFFLOAD_DECODE_BYTES
from nograd.schema.config import ModelConfig
from nograd.serving.calls.validation import Declared, check_declared
from nograd.serving.errors import InvalidInput, LimitExceeded
from nograd.serving.registry import ServedModel

HOSTILE_ELEMENTS = 15_728_640
"""60 MiB of empty BYTES elements (a 4-byte length prefix each), as an outside attacker sent."""


def one_input(
    shape: list[int],
    datatype: str = "FP32",
    *,
    raw: bytes | None = None,
    field: str | None = None,
    values: list[Any] | None = None,
    name: str = "x",
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
    if raw is not None:
        request.raw_input_contents.append(raw)
    if field is not None:
        getattr(tensor.contents, field).extend(values or [])
    return request


def texts_model(tmp_path: Path, shape: list[int]) -> ServedModel:
    config = ModelConfig.model_validate(
        {
            "name": "texts",
            "weights": "",
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": shape}],
            "outputs": [{"name": "v", "datatype": "FP32", "shape": [3]}],
        }
    )
    return ServedModel(config, tmp_path)


@pytest.mark.parametrize(
    ("shape", "fragment"),
    [
        ([1] * 70, f"70 dimensions is too large; the limit is {MAX_DIMS}"),
        ([0, 2**62, 2**62], "is too large; the limit is 1099511627776 elements"),
        ([2, -1], "negative dimension"),
    ],
    ids=["rank-70", "empty-with-huge-dims", "negative"],
)
@pytest.mark.parametrize("typed", [False, True], ids=["raw", "typed"])
def test_shapes_numpy_cannot_describe_are_refused_naming_the_input(
    shape: list[int], fragment: str, typed: bool
) -> None:
    """Each of these crashed numpy (an INTERNAL answer) before the shape was checked."""
    request = (
        one_input(shape, field="fp32_contents", values=[])
        if typed
        else one_input(shape, raw=b"\0" * 4)
    )
    with pytest.raises(DecodeError, match=f"input 'x': .*{fragment}"):
        decode_inputs(request)


def test_typed_values_convert_exactly() -> None:
    """2**64-1 in uint64_contents crashed the conversion (through int64) with INTERNAL."""
    largest = decode_inputs(
        one_input([2], "UINT64", field="uint64_contents", values=[2**64 - 1, 0])
    )
    assert largest["x"].dtype == np.uint64 and largest["x"].tolist() == [2**64 - 1, 0]
    smallest = decode_inputs(one_input([1], "INT64", field="int64_contents", values=[-(2**63)]))
    assert smallest["x"].tolist() == [-(2**63)]
    narrow = decode_inputs(one_input([2], "INT8", field="int_contents", values=[-128, 127]))
    assert narrow["x"].dtype == np.int8 and narrow["x"].tolist() == [-128, 127]


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (
            one_input([1], "UINT8", field="uint64_contents", values=[2**64 - 1]),
            "contents.uint64_contents holds values, but UINT8 travels in contents.uint_contents",
        ),
        (
            one_input([1], "UINT8", field="uint_contents", values=[300]),
            r"value 300 in contents.uint_contents is out of range for UINT8 \(0 to 255\)",
        ),
        (
            one_input([2], "INT16", field="int_contents", values=[1, -40000]),
            r"value -40000 .* out of range for INT16 \(-32768 to 32767\)",
        ),
    ],
    ids=["uint64-field-for-UINT8", "UINT8-300", "INT16--40000"],
)
def test_typed_values_a_datatype_cannot_hold_are_refused_naming_the_range(
    request_: pb.ModelInferRequest, message: str
) -> None:
    with pytest.raises(DecodeError, match=f"input 'x': {message}"):
        decode_inputs(request_)


@pytest.mark.parametrize(
    ("request_", "fragment"),
    [
        (one_input([3], field="fp32_contents", values=[1.0]), "needs 3 values, .* holds 1"),
        (one_input([2], raw=b"\0" * 4), "needs 8 bytes"),
        (one_input([3], "BYTES", raw=b"\0" * 8), "3 BYTES elements need at least 12 bytes"),
        (one_input([1], "BYTES", raw=b"\0" * 8), "4 bytes left after the 1 BYTES elements"),
        (one_input([1], "FP16", field="fp32_contents", values=[1.0]), "only in raw"),
    ],
    ids=["typed-count", "raw-size", "bytes-too-short", "bytes-left-over", "fp16-typed"],
)
def test_contents_must_hold_what_the_shape_needs(
    request_: pb.ModelInferRequest, fragment: str
) -> None:
    with pytest.raises(DecodeError, match=f"input 'x': .*{fragment}"):
        decode_inputs(request_)


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
def test_several_inputs_each_decode_to_their_own_array(raw: bool) -> None:
    request = pb.ModelInferRequest(model_name="m")
    text = request.inputs.add(name="text", datatype="BYTES", shape=[2])
    ids = request.inputs.add(name="ids", datatype="INT32", shape=[2, 1])
    if raw:
        request.raw_input_contents.extend([b"\2\0\0\0hi\0\0\0\0", b"\7\0\0\0\xf9\xff\xff\xff"])
    else:
        text.contents.bytes_contents.extend([b"hi", b""])
        ids.contents.int_contents.extend([7, -7])
    inputs = decode_inputs(request)
    assert inputs["text"].tolist() == [b"hi", b""]
    assert inputs["ids"].dtype == np.int32 and inputs["ids"].tolist() == [[7], [-7]]


def test_raw_and_typed_contents_together_are_refused_in_tritons_words() -> None:
    request = one_input([1], raw=b"\0" * 4, field="fp32_contents", values=[0.0])
    with pytest.raises(DecodeError) as refused:
        decode_inputs(request)
    assert str(refused.value) == (
        "contents field must not be specified when using raw_input_contents for 'x' for model 'm'"
    )


def test_typed_contents_beside_any_raw_input_are_refused_before_counting_them() -> None:
    """Triton's explicit-content example clients: both inputs typed, then one raw tensor added
    and the first input's contents replaced; Triton names the first input, not the count."""
    request = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        tensor.contents.int_contents.extend(range(16))
    request.raw_input_contents.append(np.arange(8).tobytes())
    with pytest.raises(DecodeError) as refused:
        check_inputs(request)
    assert str(refused.value) == (
        "contents field must not be specified when using raw_input_contents for 'INPUT0' for "
        "model 'simple'"
    )


def test_the_model_s_check_sees_every_header_before_any_size_or_value() -> None:
    """The serving core's check comes before the contents are looked at: a request over the
    model's limits is refused for what its header says, whatever its contents hold."""
    seen: list[Declared] = []

    def refuse(declared: Declared) -> None:
        seen.append(dict(declared))
        raise LimitExceeded("over")

    request = one_input([5, 2], field="fp32_contents", values=[1.0])  # 1 of 10 values
    with pytest.raises(LimitExceeded, match="over"):
        decode_inputs(request, refuse)
    assert seen == [{"x": ("FP32", (5, 2))}]


@pytest.mark.parametrize("typed", [False, True], ids=["raw_input_contents", "bytes_contents"])
def test_a_hostile_bytes_tensor_is_refused_before_its_elements_are_parsed(
    tmp_path: Path, typed: bool
) -> None:
    """15.7M empty elements to a one-text-per-row model took 9-10 s of parsing (raw) on the event
    loop before the row limit refused them; the declared shape alone is refused now."""
    model = texts_model(tmp_path, [])
    wire = one_input([HOSTILE_ELEMENTS], "BYTES", name="text")
    if typed:
        wire.inputs[0].contents.bytes_contents.extend([b""] * HOSTILE_ELEMENTS)
    else:
        wire.raw_input_contents.append(bytes(4 * HOSTILE_ELEMENTS))
    request = pb.ModelInferRequest.FromString(wire.SerializeToString())

    def check(declared: Declared) -> None:
        check_declared(model, declared, max_rows=4096)

    started = time.perf_counter()
    with pytest.raises(
        LimitExceeded, match=r"input 'text' has 15728640 rows, .*limit of 4096 \(NOGRAD_MAX_REQ"
    ):
        decode_inputs(request, check)
    assert time.perf_counter() - started < 2.0
    request.inputs[0].ClearField("shape")
    request.inputs[0].shape.extend([1, HOSTILE_ELEMENTS])
    started = time.perf_counter()
    with pytest.raises(
        InvalidInput, match=r"unexpected shape for input 'text' .* got \[1,15728640\]"
    ):
        decode_inputs(request, check)
    assert time.perf_counter() - started < 2.0


async def test_large_tensors_are_decoded_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model with a variable dimension may take many BYTES elements within its limits; their
    parsing leaves the event loop past the size HTTP decodes a body in a thread at."""
    model = texts_model(tmp_path, [-1])
    threads: list[int] = []
    build = tensors._arrays

    def spy(*args: Any) -> dict[str, np.ndarray]:
        threads.append(threading.get_ident())
        return build(*args)

    monkeypatch.setattr(tensors, "_arrays", spy)

    def check(declared: Declared) -> None:
        check_declared(model, declared, max_rows=4096)

    small = one_input([1, 2], "BYTES", name="text", raw=b"\1\0\0\0a\0\0\0\0")
    elements = OFFLOAD_DECODE_BYTES // 4 + 1
    large = one_input([1, elements], "BYTES", name="text", raw=bytes(4 * elements))
    assert (await read_inputs(small, check))["text"].tolist() == [[b"a", b""]]
    assert (await read_inputs(large, check))["text"].shape == (1, elements)
    loop = threading.get_ident()
    assert threads[0] == loop and threads[1] != loop
    with pytest.raises(LimitExceeded):  # refused on the loop, before any thread
        await read_inputs(one_input([4097, 1], "BYTES", name="text", raw=bytes(4 * 4097)), check)
    assert len(threads) == 2
    assert check_inputs(small, check) == {"text": ("BYTES", (1, 2))}


def test_typed_contents_of_an_input_in_shared_memory_are_refused_in_tritons_words() -> None:
    request = one_input([1], field="fp32_contents", values=[0.0])
    tensor = request.inputs[0]
    tensor.parameters["shared_memory_region"].string_param = "region"
    tensor.parameters["shared_memory_byte_size"].int64_param = 4
    with pytest.raises(DecodeError) as refused:
        check_inputs(request)
    assert str(refused.value) == (
        "unexpected 'content' provided when using shared memory for input tensor 'x' for model 'm'"
    )
