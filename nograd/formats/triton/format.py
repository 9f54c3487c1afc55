"""Triton's format as the table's row: a folder with ``config.pbtxt``, or with a model file
Triton's auto-complete recognises in a numbered version folder."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from nograd.formats.source import ModelSource, Override, shared_config_source
from nograd.formats.triton.reading.config import is_triton_folder, read_triton
from nograd.schema.config import ModelConfig, find_config

BATCH_NOTE: Final = (
    "NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to "
    "be prepended to each input shape. If you want to specify the full shape including the batch "
    "dim in your input dims config, try setting max_batch_size to zero. See the model "
    "configuration docs for more info on max_batch_size."
)
"""What Triton adds to a shape refusal for a model with a batch dimension."""


@dataclass(frozen=True)
class TritonFormat:
    """Its runner serves the Python backend; the artifact backends (ONNX, PyTorch) are read into
    an engine's artifact, which nograd's own runner opens."""

    name: str = "triton"
    runner: str = "nograd.formats.triton.running.runner:build"
    warmup: str | None = "nograd.formats.triton.running.warmup:warm_up_model"
    refuses_rows_over_batch_limit: bool = True
    shape_refusal_note: str = BATCH_NOTE

    def recognises(self, entry: Path) -> bool:
        # A folder with nograd's own config is nograd's, whatever else it holds.
        return entry.is_dir() and find_config(entry) is None and is_triton_folder(entry)

    def read(
        self, folder: Path, override: Override | None, versions: Collection[str] | None
    ) -> ModelSource:
        # One config.pbtxt for every numbered version folder.
        return shared_config_source(read_triton(folder), folder, override, versions)

    def reads(self, config: ModelConfig) -> bool:
        return config.triton_config is not None

    def serves(self, config: ModelConfig) -> bool:
        # A Python-backend model (``model.py`` defining ``TritonPythonModel``).
        return self.reads(config) and config.backend == "python"

    def label(self, config: ModelConfig) -> str:
        return f"triton/{config.format}"


TRITON: Final = TritonFormat()
