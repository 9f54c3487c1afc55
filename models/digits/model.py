"""A small CNN for sklearn's 8x8 handwritten digits, served by nograd.

The server imports this file, calls :func:`build`, and loads ``model.safetensors`` into the result
with ``load_state_dict(strict=True)``, so the module tree here must match the shipped weights
exactly. ``train.py`` in this folder produces those weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

PIXEL_MAX = 16.0
"""sklearn's digits are 4-bit intensities (0..16); clients send them raw and the model scales."""
NUM_CLASSES = 10


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, one 2x2 max pool and a two-layer linear head (about 38k parameters).

    There is no BatchNorm or Dropout: every sample's output depends on that sample alone, in train
    and eval mode, so the server's dynamic batching cannot change a prediction.
    """

    def __init__(self) -> None:
        super().__init__()
        # Padding 1 keeps the 8x8 grid through both convolutions; the pool then halves it to 4x4,
        # which is as far as such a small image can shrink before strokes merge.
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Linear(64, NUM_CLASSES),
        )

    def forward(self, image: Tensor) -> dict[str, Tensor]:
        """Classify a batch of digits.

        ``image`` is ``[B, 1, 8, 8]`` float32 with raw pixel values 0..16, exactly as
        ``sklearn.datasets.load_digits`` gives them, so clients need no preprocessing of their own.
        Returns ``logits`` and ``probabilities`` (``[B, 10]`` float32) and ``label``
        (``[B, 1]`` int64: one value per sample, as the serving contract wants a per-sample shape).
        """
        logits = self.head(self.features(image / PIXEL_MAX))
        return {
            "logits": logits,
            "probabilities": torch.softmax(logits, dim=1),
            "label": torch.argmax(logits, dim=1, keepdim=True),
        }


def build(model_dir: Path) -> nn.Module:
    """Return an untrained :class:`DigitsCNN`; the server loads the weights from ``model_dir``."""
    del model_dir  # The architecture is fixed; nothing in the folder configures it.
    return DigitsCNN()
