"""The engines nograd serves with, as one table: every list of engine names derives from it.

Settings, model configs, ``nograd export`` and the engine choice all read this table, so adding
an engine is one module in ``nograd/runtime/engines/`` (the :class:`Engine` protocol there) and
one row here. The table imports no torch: the settings and the command line validate names
before any worker loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

EAGER: Final = "eager"
"""torch eager: the model's own forward (with its speed mode); no artifact."""
AUTO: Final = "auto"
"""Every engine in a config's ``engines`` built, checked and timed; the fastest serves."""


@dataclass(frozen=True)
class EngineRow:
    """One engine: its name, its artifact, and where it is implemented."""

    name: str
    suffix: str
    """File suffix of its artifact."""
    implementation: str
    """``module:attribute`` of the object implementing ``nograd.runtime.engines.registry.Engine``
    (imported by the runtime only, so this table stays free of torch)."""
    reads_signature: bool = False
    """Its artifact names its inputs and outputs, so a config of that format may leave them out."""
    int8_of: str | None = None
    """Set on a quantised variant: the engine whose ``precision = "int8"`` builds this one. A
    variant is not a name of its own in configs, settings or ``nograd export --to``."""
    auto_default: bool = False
    """Among the engines ``auto`` considers when a config lists none."""
    buildable: bool = True
    """nograd builds its artifact from a python model (``engine``, ``nograd export --to``); False:
    a format nograd only serves as it is brought."""
    eager_forward: bool = False
    """Its artifact loads as a torch module, which may stand as the eager forward that other
    engines are built from and checked against (a config of that format may opt in to one)."""


ENGINES: Final[tuple[EngineRow, ...]] = (
    EngineRow(
        "torch_export",
        ".pt2",
        "nograd.runtime.engines.program:TORCH_EXPORT",
        reads_signature=True,
    ),
    EngineRow("aoti", ".pt2", "nograd.runtime.engines.aoti:AOTI"),
    EngineRow(
        "onnx",
        ".onnx",
        "nograd.runtime.engines.onnx:ONNX",
        reads_signature=True,
        auto_default=True,
    ),
    EngineRow("onnx-int8", ".onnx", "nograd.runtime.engines.onnx:ONNX_INT8", int8_of="onnx"),
    EngineRow(
        "torchscript",
        ".pt",
        "nograd.runtime.engines.torchscript:TORCHSCRIPT",
        eager_forward=True,
    ),
)


def engine_row(name: str) -> EngineRow:
    """The row of ``name``; a KeyError naming the known engines otherwise."""
    for row in ENGINES:
        if row.name == name:
            return row
    raise KeyError(f"unknown engine {name!r}; known: {', '.join(r.name for r in ENGINES)}")


def artifact_engines() -> tuple[str, ...]:
    """Engines a config, a setting or ``nograd export --to`` may name: every row but the
    quantised variants. Also the artifact formats a model folder may hold."""
    return tuple(row.name for row in ENGINES if row.int8_of is None)


def built_engines() -> tuple[str, ...]:
    """The artifact engines nograd builds from a python model: what ``engine``, ``engines`` and
    ``nograd export --to`` may name."""
    return tuple(name for name in artifact_engines() if engine_row(name).buildable)


def engine_choices() -> tuple[str, ...]:
    """What a config's ``engine`` (and ``NOGRAD_ENGINE``) may be."""
    return (EAGER, AUTO, *built_engines())


def auto_defaults() -> tuple[str, ...]:
    """The engines ``auto`` considers by default: eager and the rows marked for it."""
    return (EAGER, *(row.name for row in ENGINES if row.auto_default))


def signature_formats() -> tuple[str, ...]:
    """Artifact formats whose files name their own inputs and outputs."""
    return tuple(row.name for row in ENGINES if row.reads_signature)


def int8_variant(name: str) -> str | None:
    """The quantised variant ``precision = "int8"`` turns engine ``name`` into, if it has one."""
    return next((row.name for row in ENGINES if row.int8_of == name), None)
