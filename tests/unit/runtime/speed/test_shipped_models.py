"""The shipped models' speed modes, and the accuracy sample read from a model folder."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nograd.observability.metrics import Metrics
from nograd.runtime.handler import ModelHandler, TorchRunner
from nograd.runtime.loader import build_handler
from nograd.runtime.speed.guard import (
    apply_speed,
    sequence_inputs,
)
from nograd.runtime.speed.path import batch_cap
from nograd.schema.config import ModelConfig, TensorSpec, load_config
from nograd.serving.extensions.speed_checks import load_accuracy_sample, recorder
from tests.unit.runtime.speed.conftest import (
    CPU,
    Tiny,
    gauge,
    rows_of,
    tiny,
    tiny_config,
)

ROOT = Path(__file__).resolve().parents[4]


def shipped(name: str, **levers: Any) -> ModelHandler:
    raw = load_config(ROOT / "models" / name / "config.toml").model_dump()
    raw.update(levers)
    config = ModelConfig.model_validate(raw)
    return build_handler(ROOT / "models", ROOT / "models" / name, config, CPU)


def test_minilm_bucket_padding_leaves_embeddings_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real BERT, real tokens: padded rows and masked padding tokens change nothing (compile is
    an identity here, so what is checked is the padding, under the fp32 tolerance). Few shapes:
    each new shape costs oneDNN a first-time kernel build on CPU."""
    monkeypatch.setattr(torch, "compile", lambda model, **options: model)
    handler = shipped("minilm", compile=True, compile_buckets=[2], compile_length_buckets=[32])
    assert sequence_inputs(handler) == frozenset({"input_ids", "attention_mask", "token_type_ids"})
    served = apply_speed(handler, limit=72)
    assert served.speed_mode == "compile", "padding moved embeddings beyond 1e-4"
    assert batch_cap(served) == 2 * 32
    texts = np.array([b"A man is eating food.", b"Short.", b"x " * 20], dtype=np.object_)
    out = TorchRunner(served).run_batch([served.prepare({"text": texts})])[0]
    assert out["embedding"].shape == (3, 384)
    assert out["token_count"][:, 0].tolist()[1] == 4


def test_minilm_bf16_autocast_keeps_packing_and_passes_its_check() -> None:
    """Autocast fixes no shapes, so minilm's forward still skips padding under it; the accuracy
    check (against fp32 eager, padded and packed alike) must accept the packed bf16 forward."""
    handler = shipped("minilm", precision="bf16", autocast=True)
    metrics = Metrics()
    served = apply_speed(handler, limit=256, report_check=recorder(metrics))
    assert served.speed_mode == "bf16-autocast"
    assert served.speed_path is not None and not served.speed_path.fixed_shapes
    delta = gauge(metrics, "nograd_model_accuracy_delta", "minilm", "bf16-autocast")
    assert delta is not None and delta < 2e-2
    calls: list[bool] = []
    module = served.module

    def spy(*tensors: torch.Tensor, packed: bool) -> torch.Tensor:
        calls.append(packed)
        return module(*tensors, packed=packed)

    texts = np.array([b"A man is eating food.", b"Short."], dtype=np.object_)
    served.module = spy  # type: ignore[assignment]
    try:
        out = TorchRunner(served).run_batch([served.prepare({"text": texts})])[0]
    finally:
        served.module = module
    assert calls == [True]
    assert out["embedding"].shape == (2, 384)


def test_shipped_digits_channels_last_converts_weights_and_inputs_and_passes_its_check() -> None:
    metrics = Metrics()
    reference = shipped("digits", channels_last=False)
    handler = shipped("digits")
    sample = load_accuracy_sample(handler, ROOT / "models" / "digits")
    served = apply_speed(handler, 64, sample, recorder(metrics))
    assert served.speed_mode == "channels_last"
    conv = served.module.features[2].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    part = served.example(rows=5)
    batch = served.collate([part])
    assert batch["image"].is_contiguous(memory_format=torch.channels_last)
    assert reference.collate([part])["image"].is_contiguous()
    out = TorchRunner(served).run_batch([part])[0]
    expected = TorchRunner(reference).run_batch([part])[0]
    np.testing.assert_allclose(out["logits"], expected["logits"], atol=1e-5)
    assert (out["label"] == expected["label"]).all()
    delta = gauge(metrics, "nograd_model_accuracy_delta", "digits", "channels_last")
    assert delta is not None and delta < 1e-4


class FlattensWithView(torch.nn.Module):
    """A convolution model written for contiguous feature maps: ``view`` cannot flatten NHWC."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(1, 2, kernel_size=3, padding=1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        features = self.conv(image)
        return features.view(features.shape[0], -1).sum(dim=1, keepdim=True)


def test_channels_last_on_a_model_that_views_feature_maps_falls_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = ModelConfig(
        name="viewer",
        weights=None,
        inputs=(TensorSpec(name="image", datatype="FP32", shape=(1, 4, 4)),),
        outputs=(TensorSpec(name="total", datatype="FP32", shape=(1,)),),
        channels_last=True,
    )
    handler = ModelHandler(FlattensWithView().eval(), config, CPU)
    with caplog.at_level(logging.WARNING, "nograd.runtime.speed.guard"):
        served = apply_speed(handler, limit=8)
    assert served.speed_mode == "fp32"
    assert "speed mode channels_last refused, serving fp32 eager: building it failed" in caplog.text
    assert served.memory_format is torch.contiguous_format
    assert served.module.conv.weight.is_contiguous()
    out = TorchRunner(served).run_batch([served.example(rows=3)])[0]
    assert out["total"].shape == (3, 1)


def test_digits_bf16_is_within_the_default_tolerance() -> None:
    metrics = Metrics()
    handler = shipped("digits", precision="bf16", channels_last=False)
    served = apply_speed(handler, limit=64, report_check=recorder(metrics))
    assert served.speed_mode == "bf16"
    delta = gauge(metrics, "nograd_model_accuracy_delta", "digits", "bf16")
    assert delta is not None and delta < 1e-2


def test_digits_bf16_is_refused_on_its_real_sample(caplog: pytest.LogCaptureFixture) -> None:
    """Synthetic pixels (0..1) pass bf16; the two real digits of sample.json (0..16) do not:
    logits of real inputs are larger, and so is their bf16 rounding."""
    metrics = Metrics()
    handler = shipped("digits", precision="bf16", channels_last=False)
    with caplog.at_level(logging.WARNING, "nograd.runtime.speed.guard"):
        sample = load_accuracy_sample(handler, ROOT / "models" / "digits")
        served = apply_speed(handler, 64, sample, recorder(metrics))
    assert served.speed_mode == "fp32"
    assert "output 'logits' max abs error" in caplog.text
    delta = gauge(metrics, "nograd_model_accuracy_delta", "digits", "bf16")
    assert delta is not None and delta > 1e-2


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{not json", "malformed JSON"),
        ('{"inputs": [{"name": "z", "shape": [1], "datatype": "FP32", "data": [1]}]}', "['z']"),
        (
            '{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}',
            "input 'x' is FP32 [1, 2]; the model takes FP32 [-1, 4]",
        ),
        (None, "No such file"),
    ],
)
def test_unreadable_accuracy_sample_fails_naming_the_field(
    tmp_path: Path, content: str | None, words: str
) -> None:
    if content is not None:
        (tmp_path / "sample.json").write_text(content)
    handler = ModelHandler(Tiny().eval(), tiny_config(precision="bf16"), CPU)
    handler.config = tiny_config(precision="bf16", accuracy_sample="sample.json")
    with pytest.raises(ValueError, match="field 'accuracy_sample'") as raised:
        load_accuracy_sample(handler, tmp_path)
    assert words in str(raised.value)


def test_accuracy_sample_must_stay_inside_the_model_folder() -> None:
    with pytest.raises(ValueError, match="inside the model folder"):
        tiny_config(accuracy_sample="../other/sample.json")


@pytest.mark.slow
def test_real_inductor_compile_serves_or_falls_back_cleanly() -> None:
    """Real torch.compile (inductor, C++ codegen): about 15-30 s on 2 cores."""
    handler = tiny(compile=True, compile_buckets=(1, 8))
    served = apply_speed(handler, limit=8, report_check=recorder(Metrics()))
    assert served.speed_mode in ("compile", "fp32")
    out = TorchRunner(served).run_batch([rows_of(*range(11))])[0]
    assert out["y"].shape == (11, 3)
