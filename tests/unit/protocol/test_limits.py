"""The estimate of a JSON body's memory once decoded, made before parsing it: never below what
decoding it takes, whatever the body holds, and cheap for a body far past the bound."""

from __future__ import annotations

import time
import tracemalloc

import orjson
import pytest

from nograd.protocol.limits import json_decoded_bytes
from nograd.protocol.v2 import decode_body


def _body(datatype: str, data: list[object], shape: list[int]) -> bytes:
    tensor = {"name": "x", "shape": shape, "datatype": datatype, "data": data}
    return orjson.dumps({"inputs": [tensor]})


CASES = {
    "zeros": _body("FP32", [0] * 100_000, [100_000]),
    "fractions": _body("FP32", [0.123] * 100_000, [100_000]),
    "nested rows": _body("FP32", [[0]] * 100_000, [100_000, 1]),
    "short texts": _body("BYTES", ["ab"] * 100_000, [100_000]),
    "long texts": _body("BYTES", ["word " * 12_000] * 50, [50]),
}


@pytest.mark.parametrize("body", CASES.values(), ids=list(CASES))
def test_the_estimate_covers_what_decoding_takes(body: bytes) -> None:
    tracemalloc.start()
    try:
        decode_body(body, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    estimate = json_decoded_bytes(body, 2**62)
    assert peak <= estimate <= 4 * peak + 4096


def test_a_body_far_past_the_bound_is_not_scanned_whole() -> None:
    body = b"0," * (16 * 1024 * 1024)
    started = time.perf_counter()
    estimate = json_decoded_bytes(body, 64 * 1024 * 1024)
    assert estimate > 64 * 1024 * 1024
    assert time.perf_counter() - started < 0.5
    bounded = json_decoded_bytes(body[: 4 * 1024 * 1024], 64 * 1024 * 1024)
    assert bounded > 64 * 1024 * 1024  # stopped after a slice or two, still past the bound
