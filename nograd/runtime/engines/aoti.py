"""AOTInductor: the traced forward compiled ahead of time to a shared library (C++ and the
system compiler), packaged with its weights, and run without Python between the kernels.

Its library allocates its buffers itself, through torch's C++ allocator and never through the
Python dispatcher, so no torch counter of Python operators sees them: on CPU its memory is the
process's peak (as every engine's); on CUDA those buffers come from torch's caching allocator,
whose counters see them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import torch

from nograd.core.engines import EngineRow, engine_row
from nograd.runtime.engines.errors import ArtifactError
from nograd.runtime.engines.paths import EnginePath
from nograd.runtime.engines.program import TorchProgramPath

if TYPE_CHECKING:
    from nograd.runtime.engines.trace import Traced
    from nograd.schema.config import TensorSpec


@dataclass(frozen=True)
class AotiEngine:
    """``aoti_compile_and_package`` to build (for the traced program's device),
    ``aoti_load_package`` to open; the batch dimension stays symbolic."""

    row: EngineRow

    def unsupported(self, device: torch.device) -> str | None:
        return None

    def build(self, traced: Traced, target: Path) -> None:
        package = torch._inductor.aoti_compile_and_package(traced.program, package_path=str(target))
        if Path(package) != target:
            os.replace(package, target)

    def open(self, path: Path, device: torch.device) -> EnginePath:
        index = (device.index or 0) if device.type == "cuda" else -1
        compiled = torch._inductor.aoti_load_package(str(path), device_index=index)
        return TorchProgramPath(self.row.name, compiled)

    def signature(self, path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        raise ArtifactError(f"{path}: an aoti package does not name its inputs and outputs")


AOTI: Final = AotiEngine(engine_row("aoti"))
