"""TorchServe's MNIST example archived the way TorchServe's users archive it: the real
``torch-model-archiver`` over TorchServe's example sources (``tests/fixtures/torchserve/mnist``,
read as data), with a seeded state dict where the original weights are a download.

The bench serves this ``mnist.mar`` with nograd and with TorchServe (``bench.phases.archives``);
the tests build it and their other archives with the same functions (``tests/torchserve_archives``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[2]
FIXTURES: Final = ROOT / "tests" / "fixtures" / "torchserve"
MNIST: Final = FIXTURES / "mnist"
DIGITS: Final = {name: (MNIST / f"{name}.png").read_bytes() for name in ("0", "1", "7")}
"""TorchServe's MNIST test images (``examples/image_classifier/mnist/test_data``)."""
ARCHIVE_TIMEOUT_S: Final = 120


def archive(store: Path, name: str, *args: str, python: Path | None = None) -> Path:
    """``torch-model-archiver --model-name name ... --export-path store --force`` run by
    ``python`` (a venv with ``model_archiver``; this interpreter by default)."""
    archiver = [str(python or sys.executable), "-m", "model_archiver.model_packaging"]
    subprocess.run(
        [*archiver, "--model-name", name, "--export-path", str(store), *args, "--force"],
        check=True,
        capture_output=True,
        timeout=ARCHIVE_TIMEOUT_S,
    )
    return store / f"{name}.mar"


def mnist_weights(path: Path) -> Path:
    """A seeded state dict of TorchServe's MNIST ``Net``."""
    import torch

    spec = importlib.util.spec_from_file_location("ts_fixture_mnist", MNIST / "mnist.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    torch.save(module.Net().state_dict(), path)
    return path


def build_mnist(store: Path, work: Path, python: Path | None = None) -> Path:
    """``store/mnist.mar``: TorchServe's MNIST example on its custom handler, batching from its
    ``model-config.yaml`` (batchSize 8, maxBatchDelay 200 ms, one worker)."""
    store.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    return archive(
        store,
        "mnist",
        "--version", "1.0",
        "--model-file", str(MNIST / "mnist.py"),
        "--serialized-file", str(mnist_weights(work / "mnist_cnn.pt")),
        "--handler", str(MNIST / "mnist_handler.py"),
        "--config-file", str(MNIST / "model-config.yaml"),
        python=python,
    )  # fmt: skip
