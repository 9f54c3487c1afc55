"""``torch.export`` programs: the traced forward saved as a ``.pt2`` archive and run by torch.

Its forward runs torch's own operators, so its memory is torch's: the process's peak on CPU (as
every engine's) and the caching allocator's counters on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch

from nograd.core.engines import EngineRow, engine_row
from nograd.runtime.engines.errors import ArtifactError
from nograd.runtime.engines.paths import EnginePath
from nograd.runtime.engines.signature import tensor_spec
from nograd.runtime.handler import TORCH_DTYPES, ModelHandler

if TYPE_CHECKING:
    from nograd.runtime.engines.trace import Traced
    from nograd.schema.config import TensorSpec

_DATATYPE_OF_TORCH: Final = {dtype: name for name, dtype in TORCH_DTYPES.items()}


class TorchProgramPath(EnginePath):
    """A ``torch.export`` program's module, or an AOTInductor package's compiled model: both
    take the collated tensors as one dict and give the outputs as a dict, by name."""

    def __init__(self, name: str, run: Callable[[dict[str, torch.Tensor]], Any]) -> None:
        super().__init__((), ())
        self.name = name
        self._run = run

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        result = self._run(self.plain(batch))
        if not isinstance(result, Mapping):
            raise ArtifactError(
                f"the {self.name} artifact returned {type(result).__name__}, not a dict of "
                "outputs by name (export it with nograd export)"
            )
        return result

    def check_inputs(self, handler: ModelHandler) -> None:
        """Checked by the program itself: its call spec names the dict's keys."""


@dataclass(frozen=True)
class TorchExportEngine:
    """``torch.export.save`` to build, ``torch.export.load`` to open."""

    row: EngineRow

    def unsupported(self, device: torch.device) -> str | None:
        return None

    def build(self, traced: Traced, target: Path) -> None:
        torch.export.save(traced.program, str(target))

    def open(self, path: Path, device: torch.device) -> EnginePath:
        module = torch.export.load(str(path)).module()
        module.to(device)
        return TorchProgramPath(self.row.name, module)

    def signature(self, path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        program = torch.export.load(str(path))
        nodes = {node.name: node for node in program.graph.nodes}
        input_names, output_names = program_names(program)
        signature = program.graph_signature
        user_outputs = list(signature.user_outputs)
        if output_names is None:
            output_names = [f"output_{index}" for index in range(len(user_outputs))]

        def spec(node_name: str, label: str) -> TensorSpec:
            value = nodes[node_name].meta.get("val") if node_name in nodes else None
            if not isinstance(value, torch.Tensor):
                raise ArtifactError(f"{path}: {label!r} is not a tensor")
            shape = [dim if isinstance(dim, int) else -1 for dim in value.shape]
            return tensor_spec(path, label, _DATATYPE_OF_TORCH.get(value.dtype), shape)

        inputs = tuple(
            spec(node, label)
            for node, label in zip(signature.user_inputs, input_names, strict=True)
        )
        outputs = tuple(
            spec(node, label) for node, label in zip(user_outputs, output_names, strict=True)
        )
        return inputs, outputs


TORCH_EXPORT: Final = TorchExportEngine(engine_row("torch_export"))


def program_names(program: Any) -> tuple[list[str], list[str] | None]:
    """The input and output names of a program traced as nograd traces (a dict in, a dict out);
    ``torch.export`` keeps them in its call spec. Output names are None for a tuple out."""
    in_spec, out_spec = program.call_spec.in_spec, program.call_spec.out_spec
    args = in_spec.children_specs[0] if in_spec is not None else None
    first = args.children_specs[0] if args is not None and args.children_specs else None
    if args is None or first is None or first.type is not dict or len(args.children_specs) != 1:
        raise ArtifactError("the program must take one dict of tensors, as nograd export writes")
    outputs = list(out_spec.context) if out_spec is not None and out_spec.type is dict else None
    return list(first.context), outputs
