"""Train the digits CNN and write ``model.safetensors``, ``metrics.json`` and ``sample.json``.

Run from the repository root: ``python models/digits/train.py`` (needs scikit-learn, which is in
the ``dev`` extras; the data set ships inside sklearn, so nothing is downloaded). Seeds, the split
and deterministic kernels are fixed so a rerun on the same torch build gives the same weights.

The unit tests import :func:`heldout_split` from this file, so the accuracy they check is measured
on exactly the samples training never saw.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import save_file
from sklearn.datasets import load_digits  # type: ignore[import-untyped]
from sklearn.model_selection import train_test_split  # type: ignore[import-untyped]
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent
SEED = 20240531
HELDOUT_FRACTION = 0.2
EPOCHS = 60
BATCH_SIZE = 64
LEARNING_RATE = 1e-3
LABEL_SMOOTHING = 0.1
"""Keeps logits small (about +-5 instead of +-35): probabilities stay informative rather than a
flat 1.0, and float32 rounding between batched and single-sample kernels stays far below 1e-5."""
SAMPLE_COUNT = 2
"""Held-out images written to ``sample.json`` as a ready-to-POST request."""


def _load_model_module() -> ModuleType:
    """Import ``model.py`` by file path, as the server does: ``models/`` is not a package."""
    spec = importlib.util.spec_from_file_location("nograd_digits_model", HERE / "model.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {HERE / 'model.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def heldout_split() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Return ``(x_train, y_train, x_heldout, y_heldout)``: a stratified, seeded 80/20 split.

    Images are ``[N, 1, 8, 8]`` float32 with raw 0..16 pixels (the model's input contract) and
    labels are int64. Stratifying keeps every digit at its natural share in both halves, so the
    held-out accuracy is not skewed by an unlucky class balance.
    """
    digits = load_digits()
    x_train, x_heldout, y_train, y_heldout = train_test_split(
        digits.images,
        digits.target,
        test_size=HELDOUT_FRACTION,
        stratify=digits.target,
        random_state=SEED,
    )

    def images(array: object) -> Tensor:
        return torch.as_tensor(array, dtype=torch.float32).unsqueeze(1).contiguous()

    def labels(array: object) -> Tensor:
        return torch.as_tensor(array, dtype=torch.int64)

    return images(x_train), labels(y_train), images(x_heldout), labels(y_heldout)


def accuracy(model: nn.Module, images: Tensor, labels: Tensor) -> float:
    """Fraction of ``images`` whose predicted label equals ``labels``, in eval mode."""
    model.eval()
    with torch.inference_mode():
        predicted = model(images)["label"].squeeze(1)
    return float((predicted == labels).float().mean().item())


def train() -> dict[str, float | int]:
    """Train from scratch, write the artefacts next to this file and return the metrics."""
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)

    x_train, y_train, x_heldout, y_heldout = heldout_split()
    model: nn.Module = _load_model_module().DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=LABEL_SMOOTHING)
    shuffle = torch.Generator().manual_seed(SEED)

    for epoch in range(1, EPOCHS + 1):
        model.train()
        order = torch.randperm(len(x_train), generator=shuffle)
        total_loss = 0.0
        for start in range(0, len(order), BATCH_SIZE):
            batch = order[start : start + BATCH_SIZE]
            optimizer.zero_grad()
            loss = loss_fn(model(x_train[batch])["logits"], y_train[batch])
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(batch)
        if epoch % 10 == 0 or epoch == EPOCHS:
            print(
                f"epoch {epoch:3d}  train loss {total_loss / len(order):.4f}  "
                f"held-out accuracy {accuracy(model, x_heldout, y_heldout):.4f}"
            )

    heldout_accuracy = accuracy(model, x_heldout, y_heldout)
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    weights_path = HERE / "model.safetensors"
    save_file(state, str(weights_path))
    # safetensors creates the file owner-only (0600); a container copying the working tree and
    # running as another user could then not read it, so make it world-readable like the rest.
    weights_path.chmod(0o644)

    metrics: dict[str, float | int] = {
        "heldout_accuracy": round(heldout_accuracy, 4),
        "n_train": len(x_train),
        "n_heldout": len(x_heldout),
        "seed": SEED,
    }
    (HERE / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")

    # The first held-out images, as a KServe V2 / Open Inference Protocol request body.
    samples = x_heldout[:SAMPLE_COUNT]
    request = {
        "inputs": [
            {
                "name": "image",
                "shape": list(samples.shape),
                "datatype": "FP32",
                "data": samples.flatten().tolist(),
            }
        ]
    }
    (HERE / "sample.json").write_text(json.dumps(request) + "\n", encoding="utf-8")

    print(f"held-out accuracy: {heldout_accuracy:.4f} ({len(x_heldout)} samples)")
    print(f"sample.json labels: {y_heldout[:SAMPLE_COUNT].tolist()}")
    return metrics


if __name__ == "__main__":
    train()
