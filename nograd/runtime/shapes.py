"""Tensors whose shape the model sees differently from the requests: Triton's ``reshape`` and
models without a batch dimension (``max_batch_size: 0``).

Requests keep the shapes the config lists, and collation the batch dimension every part has;
this handler reshapes each batch to what the model takes, and its outputs back to what the
config lists, so batching, validation and the fronts stay the same for every model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from nograd.runtime.handler import ModelHandler, Outputs, TensorPart
from nograd.schema.config import ModelConfig


def needs_shaping(config: ModelConfig) -> bool:
    """Whether the model takes or gives other shapes than its requests carry."""
    reshaped = any(spec.reshape is not None for spec in (*config.inputs, *config.outputs))
    return reshaped or config.batch_dimension is False


class ShapedHandler(ModelHandler):
    """The default handler, with each input reshaped (and the batch dimension dropped, for a
    model without one) before the forward, and each output brought back after it."""

    def collate(self, parts: Sequence[TensorPart]) -> dict[str, torch.Tensor]:
        batch = super().collate(parts)
        unbatched = self.config.batch_dimension is False
        for spec in self.config.inputs:
            tensor = batch[spec.name]
            if unbatched and tensor.shape[0] != 1:
                raise RuntimeError(
                    f"model {self.config.name!r} has no batch dimension: one request at a time"
                )
            if spec.reshape is not None:
                tensor = tensor.reshape(tensor.shape[0], *spec.reshape)
            batch[spec.name] = tensor[0] if unbatched else tensor
        return batch

    def to_numpy(self, outputs: Mapping[str, torch.Tensor], rows: int | None = None) -> Outputs:
        unbatched = self.config.batch_dimension is False
        shaped = dict(outputs)
        for spec in self.config.outputs:
            tensor = outputs[spec.name]
            if unbatched:
                tensor = tensor.unsqueeze(0)
            if spec.reshape is not None:
                tensor = tensor.reshape(tensor.shape[0], *spec.shape)
            shaped[spec.name] = tensor
        return super().to_numpy(shaped, rows)
