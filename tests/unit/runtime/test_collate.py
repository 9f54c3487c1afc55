"""Collation hands the model tensors it may change in place without touching the request."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from nograd.runtime.handler import TensorPart
from tests.unit.runtime.engines.tiny import tiny_handler


def test_a_read_only_request_tensor_reaches_the_model_as_a_writable_copy(tmp_path: Path) -> None:
    handler = tiny_handler(tmp_path)
    body = np.arange(32, dtype=np.float32).tobytes()  # as binary and gRPC tensors arrive
    view = np.frombuffer(body, dtype=np.float32).reshape(2, 16)
    assert not view.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps a read-only array
        batch = handler.collate([TensorPart({"x": view}, rows=2)])
    batch["x"].div_(255.0)  # what a model's own preprocessing may do
    assert body == np.arange(32, dtype=np.float32).tobytes()


def test_a_writable_request_tensor_is_used_in_place(tmp_path: Path) -> None:
    handler = tiny_handler(tmp_path)
    array = np.arange(32, dtype=np.float32).reshape(2, 16)  # as JSON data is decoded
    batch = handler.collate([TensorPart({"x": array}, rows=2)])
    assert batch["x"].data_ptr() == array.ctypes.data  # no copy
    assert torch.equal(batch["x"], torch.from_numpy(array))
