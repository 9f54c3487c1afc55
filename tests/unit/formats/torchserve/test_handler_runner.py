"""A TorchServe handler is the batcher's runner itself: one ``handle`` call per batch, called as
TorchServe calls it (no ``inference_mode`` of nograd's around it), each request its own answer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from nograd.core.handler_messages import RAW_FIELD, HandlerAnswer
from nograd.formats.torchserve.running.handler import ArchiveHandler, build_archive_handler
from nograd.protocol.torchserve import handler_request
from nograd.runtime.handler import ModelHandler
from nograd.runtime.runners import batch_runner
from nograd.schema.config import ModelConfig, TensorSpec

HANDLER = """
import torch

calls = []


def handle(data, context):
    if data is None:
        return None
    calls.append(len(data))
    inference = torch.is_inference_mode_enabled()
    return [{"twice": 2 * row["body"]["x"], "inference_mode": inference} for row in data]
"""
JSON = {"content-type": "application/json"}


def _archive(folder: Path) -> Path:
    (folder / "MAR-INF").mkdir(parents=True)
    manifest = {"model": {"modelName": "twice", "modelVersion": "1.0", "handler": "twice.py"}}
    (folder / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(manifest))
    (folder / "twice.py").write_text(HANDLER)
    return folder


def test_an_archive_handler_runs_its_batches_itself(tmp_path: Path) -> None:
    config = ModelConfig(
        name="twice",
        weights=None,
        inputs=(TensorSpec(name=RAW_FIELD, datatype="BYTES", shape=()),),
        outputs=(TensorSpec(name="answer", datatype="BYTES", shape=()),),
        max_batch_size=4,
    )
    runner = build_archive_handler(_archive(tmp_path / "twice"), config, torch.device("cpu"))
    assert isinstance(runner, ArchiveHandler) and not isinstance(runner, ModelHandler)
    assert batch_runner(runner) is runner
    assert (runner.synthetic_inputs, runner.weights_bytes) == (False, 0)

    def request(x: int) -> np.ndarray:
        array = np.empty(1, dtype=np.object_)
        array[0] = handler_request(json.dumps({"x": x}).encode(), JSON)
        return array

    parts = [runner.prepare({RAW_FIELD: request(3)}), runner.prepare({RAW_FIELD: request(5)})]
    answers = runner.run_batch(parts)
    bodies = []
    for answer in answers:
        (item,) = answer["answer"]
        assert isinstance(item, HandlerAnswer) and item.status == 200
        bodies.append(json.loads(item.body))
    assert bodies == [
        {"twice": 6, "inference_mode": False},
        {"twice": 10, "inference_mode": False},
    ]
    assert runner.code["twice"].calls == [2]  # one handle call for the batch
