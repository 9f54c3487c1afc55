"""What a front reads from a request's shared-memory parameters before any copy: the bytes placed
in regions in all (a large copy leaves the event loop) and those of BYTES inputs (held within
the request's limits first); a malformed parameter counts nothing, decoding refuses it."""

from __future__ import annotations

from nograd.protocol.shared_memory import BYTE_SIZE, REGION, placed_bytes


def test_placed_bytes_count_what_regions_hold_and_bytes_apart() -> None:
    tensors = [
        ("BYTES", {REGION: "a", BYTE_SIZE: 100}),
        ("INT32", {REGION: "a", BYTE_SIZE: 64}),
        ("BYTES", {BYTE_SIZE: 1 << 40}),  # no region: carried in the body
        ("BYTES", {REGION: "a", BYTE_SIZE: "100"}),  # malformed: refused when decoded
        ("BYTES", {REGION: "a", BYTE_SIZE: True}),
        ("BYTES", {REGION: "a", BYTE_SIZE: -5}),
        ("FP32", {"binary_data_size": 8}),
    ]
    assert placed_bytes(tensors) == (164, 100)
    assert placed_bytes([]) == (0, 0)
