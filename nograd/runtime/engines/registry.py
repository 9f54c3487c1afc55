"""The engine protocol, and the engines of ``nograd.core.engines``' table as objects.

An engine is one module of this package holding an object that satisfies :class:`Engine`: it
builds its artifact from the traced forward, opens it as an :class:`~nograd.runtime.engines.
paths.EnginePath` (which runs batches and says how its memory is measured), and reads the
artifact's signature when its format names one. The table row names the object; nothing else in
nograd lists engines.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from nograd.core import engines as table
from nograd.core.engines import EngineRow, engine_row

if TYPE_CHECKING:
    from nograd.runtime.engines.paths import EnginePath
    from nograd.runtime.engines.trace import Traced
    from nograd.schema.config import TensorSpec

Signature = tuple[tuple["TensorSpec", ...], tuple["TensorSpec", ...]]
"""An artifact's inputs and outputs."""


@runtime_checkable
class Engine(Protocol):
    """One way to run a model's forward, from its artifact."""

    @property
    def row(self) -> EngineRow:
        """Its row of the table: name, artifact suffix."""
        ...

    def unsupported(self, device: torch.device) -> str | None:
        """Why it cannot run on ``device``, or None when it can."""
        ...

    def build(self, traced: Traced, target: Path) -> None:
        """Write the artifact of ``traced`` to ``target`` (a temporary file the caller renames)."""
        ...

    def open(self, path: Path, device: torch.device) -> EnginePath:
        """The artifact at ``path`` loaded on ``device``, ready to run batches."""
        ...

    def signature(self, path: Path) -> Signature:
        """The inputs and outputs the artifact at ``path`` names (``row.reads_signature``)."""
        ...


class UnknownEngine(LookupError):
    """A name the engine table does not hold."""


@functools.cache
def engine(name: str) -> Engine:
    """The engine called ``name``, imported from the module its table row names."""
    try:
        row = engine_row(name)
    except KeyError as exc:
        raise UnknownEngine(str(exc.args[0])) from exc
    module_name, _, attribute = row.implementation.partition(":")
    found = getattr(importlib.import_module(module_name), attribute)
    if not isinstance(found, Engine) or found.row != row:
        raise TypeError(f"{row.implementation} does not implement engine {name!r}")
    return found


def every_engine() -> tuple[Engine, ...]:
    """Every engine of the table, in its order."""
    return tuple(engine(row.name) for row in table.ENGINES)


def open_engine(name: str, path: Path, device: torch.device) -> EnginePath:
    """Engine ``name``'s artifact at ``path`` loaded onto ``device``, its size noted as what its
    weights cost."""
    opened = engine(name).open(path, device)
    opened.weights_bytes = path.stat().st_size
    return opened
