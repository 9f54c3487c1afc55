"""A decoded request and an answer cross between processes as plain values and come back equal:
every dtype a V2 tensor has, BYTES items, non-contiguous views; arrays writable on arrival."""

from __future__ import annotations

import pickle
import pickletools
from typing import Any

import numpy as np
import pytest

from nograd.protocol.v2 import InferRequest, RequestedOutput
from nograd.protocol.v2_handover import Answer, Predecoded, array_of, array_wire

ARRAYS = {
    "fp32": np.arange(6, dtype=np.float32).reshape(2, 3),
    "fp16": np.ones((2,), dtype=np.float16),
    "int64": np.array([[1], [-2]], dtype=np.int64),
    "bool": np.array([True, False]),
    "bytes": np.array([b"a", b"bc"], dtype=np.object_).reshape(2, 1),
    "view": np.arange(12, dtype=np.int32).reshape(3, 4)[:, 1:3],
    "scalar-shape": np.zeros((1, 0), dtype=np.uint8),
}


def globals_in(wire: Any) -> list[str]:
    """The classes and functions a pickle of ``wire`` names (none for plain values)."""
    ops = pickletools.genops(pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL))
    return [op.name for op, _, _ in ops if op.name in ("GLOBAL", "STACK_GLOBAL")]


@pytest.mark.parametrize("name", list(ARRAYS))
def test_each_array_comes_back_equal_and_writable(name: str) -> None:
    array = ARRAYS[name]
    back = array_of(pickle.loads(pickle.dumps(array_wire(array))))
    assert back.shape == array.shape
    assert back.dtype == array.dtype
    np.testing.assert_array_equal(back, array)
    assert back.flags.writeable
    assert globals_in(array_wire(array)) == []


def test_a_decoded_request_crosses_as_plain_values() -> None:
    request = InferRequest(
        "r1",
        {"a": ARRAYS["fp32"], "b": ARRAYS["bytes"]},
        (RequestedOutput("y", binary=True), RequestedOutput("z", classification=2)),
        {"timeout": 10},
    )
    predecoded = Predecoded(request, {"a": ("FP32", (2, 3))}, {"timeout": 10}, 1234)
    wire = predecoded.to_wire()
    assert globals_in(wire) == []
    back = Predecoded.from_wire(pickle.loads(pickle.dumps(wire)))
    assert back.request.id == "r1"
    assert back.request.outputs == request.outputs
    assert back.request.parameters == {"timeout": 10}
    assert (back.declared, back.parameters, back.json_bytes) == (
        {"a": ("FP32", (2, 3))},
        {"timeout": 10},
        1234,
    )
    for name, array in request.inputs.items():
        np.testing.assert_array_equal(back.request.inputs[name], array)


def test_an_answer_crosses_as_plain_values() -> None:
    answer = Answer(
        "m", "2", {"y": ARRAYS["int64"]}, (RequestedOutput("y"),), None, {"sequence_id": 0}
    )
    wire = answer.to_wire()
    assert globals_in(wire) == []
    back = Answer.from_wire(pickle.loads(pickle.dumps(wire)))
    assert (back.model_name, back.model_version, back.selected, back.id, back.parameters) == (
        "m",
        "2",
        answer.selected,
        None,
        {"sequence_id": 0},
    )
    np.testing.assert_array_equal(back.outputs["y"], ARRAYS["int64"])
