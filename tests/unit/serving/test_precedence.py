"""One rule between server-wide settings and a model's own: a set server-wide value replaces the
model's (and says so), an unset one is only the default."""

from __future__ import annotations

import logging

import pytest

from nograd.formats.triton.reading.config import read_triton
from nograd.schema.config import ModelConfig, load_config
from nograd.serving.calls.precedence import effective_config
from nograd.settings import Settings
from tests.e2e.serving import ROOT
from tests.triton_models import FIXTURES


def minilm() -> ModelConfig:
    return load_config(ROOT / "models" / "minilm" / "config.toml")


def test_a_set_server_wide_value_replaces_the_models_own_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="nograd.serving.calls.precedence"):
        config = effective_config(minilm(), Settings(max_queue_size=4))
    assert config.max_queue_size == 4
    assert (
        "model minilm: max_queue_size = 4 from NOGRAD_MAX_QUEUE_SIZE replaces 1024 from its config"
        in caplog.text
    )


def test_an_unset_server_wide_value_leaves_the_models_own(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOGRAD_ENGINE", raising=False)
    with caplog.at_level(logging.INFO, logger="nograd.serving.calls.precedence"):
        config = effective_config(minilm(), Settings())
    assert config == minilm()
    assert caplog.text == ""


def test_a_set_value_fills_in_where_the_model_says_nothing_without_a_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    own = minilm().model_copy(update={"max_queue_delay_ms": None})
    with caplog.at_level(logging.INFO, logger="nograd.serving.calls.precedence"):
        config = effective_config(own, Settings(max_queue_delay_ms=5.0))
    assert config.max_queue_delay_ms == 5.0
    assert "max_queue_delay_ms" not in caplog.text


def test_a_value_set_in_the_environment_counts_as_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NOGRAD_MAX_QUEUE_SIZE", "4")
    config = effective_config(minilm(), Settings())
    assert config.max_queue_size == 4


def test_a_set_engine_reaches_triton_torchscript_models_and_no_other_artifact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``NOGRAD_ENGINE`` set: a TorchScript model (Triton's PyTorch backend) opts in to the
    engine choice as a python model does, with the line that says so; an ONNX one keeps its
    own runtime."""
    own = read_triton(FIXTURES / "cpu_instance").model_copy(update={"engine": "eager"})
    with caplog.at_level(logging.INFO, logger="nograd.serving.calls.precedence"):
        config = effective_config(own, Settings(engine="auto"))
    assert config.engine == "auto"
    assert "model cpu_instance: engine = auto from NOGRAD_ENGINE replaces eager" in caplog.text
    onnx = read_triton(FIXTURES / "simple")
    assert effective_config(onnx, Settings(engine="auto")).engine is None
