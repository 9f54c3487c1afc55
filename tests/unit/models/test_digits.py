"""The shipped digits model: its weights load strictly, it is accurate, and batching is invisible.

``models/`` is not a package, so ``model.py`` and ``train.py`` are imported by file path, the way
the server imports model modules. The held-out split comes from ``train.py`` itself, so the
accuracy checked here is on exactly the samples training never saw.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

DIGITS_DIR = Path(__file__).resolve().parents[3] / "models" / "digits"


def _import(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """``build()`` plus the shipped weights, loaded strictly as the server does, in eval mode."""
    module = _import(DIGITS_DIR / "model.py", "test_digits_model_module")
    built: torch.nn.Module = module.build(DIGITS_DIR)
    built.load_state_dict(load_file(str(DIGITS_DIR / "model.safetensors")), strict=True)
    return built.eval()


@pytest.fixture(scope="module")
def heldout() -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out images and labels of ``train.py``'s split; skipped without scikit-learn."""
    pytest.importorskip("sklearn")
    train = _import(DIGITS_DIR / "train.py", "test_digits_train_module")
    _, _, images, labels = train.heldout_split()
    return images, labels


def test_heldout_accuracy_is_at_least_95_percent(
    model: torch.nn.Module, heldout: tuple[torch.Tensor, torch.Tensor]
) -> None:
    images, labels = heldout
    with torch.inference_mode():
        predicted = model(images)["label"].squeeze(1)
    accuracy = (predicted == labels).float().mean().item()
    assert accuracy >= 0.95, f"held-out accuracy {accuracy:.4f} < 0.95 on {len(labels)} samples"


def test_batched_outputs_equal_one_by_one(
    model: torch.nn.Module, heldout: tuple[torch.Tensor, torch.Tensor]
) -> None:
    images = heldout[0][:64]
    with torch.inference_mode():
        batched = model(images)
        singles = [model(images[i : i + 1]) for i in range(len(images))]
    for name, tensor in batched.items():
        one_by_one = torch.cat([single[name] for single in singles])
        if tensor.dtype.is_floating_point:
            difference = (tensor - one_by_one).abs().max().item()
            assert difference <= 1e-5, f"{name}: batched and single differ by {difference}"
        else:
            assert torch.equal(tensor, one_by_one), f"{name}: batched and single differ"


def test_output_contract(model: torch.nn.Module) -> None:
    # Random raw-range pixels: the contract must hold for any input, not only real digits.
    images = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 16.0
    with torch.inference_mode():
        outputs = model(images)
    assert set(outputs) == {"logits", "probabilities", "label"}
    assert outputs["logits"].shape == (3, 10)
    assert outputs["logits"].dtype == torch.float32
    assert outputs["probabilities"].shape == (3, 10)
    assert outputs["probabilities"].dtype == torch.float32
    torch.testing.assert_close(outputs["probabilities"].sum(dim=1), torch.ones(3))
    assert outputs["label"].shape == (3, 1)
    assert outputs["label"].dtype == torch.int64
    assert torch.equal(outputs["label"].squeeze(1), outputs["logits"].argmax(dim=1))
