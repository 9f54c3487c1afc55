"""A handler's torch forward captured by ``torch.export``: what every engine's artifact is built
from, with a dynamic batch dimension and, for token models, a dynamic sequence dimension."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import Dim, ExportedProgram

from nograd.runtime.handler import ModelHandler
from nograd.runtime.speed.guard import sequence_inputs

MAX_EXPORT_ROWS = 65536
"""Upper bound of the exported batch dimension (the config's max_batch_size is at most this)."""
MAX_EXPORT_LENGTH = 4096
"""Upper bound of the sequence dimension when the handler does not set ``max_length``."""


class TracedForward(torch.nn.Module):
    """``handler.traced_forward`` from the collated tensors (a dict) to the config's outputs (a
    dict): a torch artifact keeps both sets of names in its signature."""

    def __init__(self, handler: ModelHandler) -> None:
        super().__init__()
        self.handler = handler
        self.model = handler.eager_module()  # registered, so export sees the weights as parameters
        self.outputs = tuple(spec.name for spec in handler.config.outputs)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        result = self.handler.traced_forward(batch)
        return {name: result[name] for name in self.outputs}


@dataclass(frozen=True)
class Traced:
    """An exported program and the names of its inputs and outputs, in signature order."""

    program: ExportedProgram
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    example: dict[str, torch.Tensor]
    """The batch it was traced with (the ONNX exporter traces again with it)."""
    forward: torch.nn.Module
    """The eager forward exported (``TracedForward``): TorchScript traces it again, as its
    tracer records the sizes an exported graph has already turned into numbers."""


def export_program(handler: ModelHandler) -> Traced:
    """Trace ``handler`` on a synthetic batch; batch (and sequence) sizes stay symbolic."""
    tokens = handler.config.batch_unit == "tokens"
    # Three rows, not one or two: torch.export specialises sizes 0 and 1, and two rows of
    # length two could be mistaken for one dimension.
    part = handler.example(3, 17) if tokens else handler.example(3)
    with torch.no_grad():
        batch = handler.collate([part])
    names = tuple(batch)
    sequence = sequence_inputs(handler)
    rows = Dim("batch", min=1, max=MAX_EXPORT_ROWS)
    length = Dim("length", min=2, max=handler.max_length or MAX_EXPORT_LENGTH)
    shapes = {name: {0: rows, 1: length} if name in sequence else {0: rows} for name in names}
    module = TracedForward(handler).eval()
    with torch.no_grad():
        program = torch.export.export(module, (batch,), dynamic_shapes=(shapes,), strict=False)
    return Traced(program, names, module.outputs, batch, module)
