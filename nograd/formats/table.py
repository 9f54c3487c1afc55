"""The model formats nograd serves, as one table: each repository entry is recognised, and each
model it reads is served, by the first format of ``FORMATS`` that claims it.

A format is one sub-package of ``nograd.formats`` whose ``format`` module holds an object that
satisfies :class:`Format`; the table's row names that object. The object and its ``reading``
part import no torch, so the fronts and the repository reader use them in a process that never
loads torch; the runtime imports the format's ``running`` part, named by ``Format.runner``, when
it builds a model. Adding a format is one sub-package and one row here.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Final, Protocol, cast, runtime_checkable

from nograd.formats.source import ModelSource, Override
from nograd.schema.config import ModelConfig

FORMATS: Final[tuple[str, ...]] = (
    "nograd.formats.torchserve.format:TORCHSERVE",
    "nograd.formats.triton.format:TRITON",
    "nograd.formats.nograd.format:NOGRAD",
)
"""``module:attribute`` of each format, in the order an entry or a config is offered to them:
nograd's own last, as it serves every config the others leave."""


@runtime_checkable
class Format(Protocol):
    """One way models arrive: how its entries are recognised and what builds its models."""

    @property
    def name(self) -> str:
        """What the format is called in logs and documents."""
        ...

    @property
    def runner(self) -> str:
        """``module:function`` building the handler of a model this format read, called as
        ``function(repository, model_dir, config, device)``; imported only where models run."""
        ...

    @property
    def warmup(self) -> str | None:
        """``module:function`` run on a model of this format once it is built, called as
        ``function(handler, model_dir)`` (a failure fails the load); None: the format has no
        warm-up of its own."""
        ...

    @property
    def refuses_rows_over_batch_limit(self) -> bool:
        """Whether a request with more rows than the model's ``max_batch_size`` is refused (as
        Triton does), rather than split across batches (as nograd's own models are)."""
        ...

    @property
    def shape_refusal_note(self) -> str:
        """What this format's server adds to a shape refusal for a model with a batch
        dimension; empty for none."""
        ...

    def recognises(self, entry: Path) -> bool:
        """Whether ``entry`` (a folder or file directly in the repository) is one of its models."""
        ...

    def reads(self, config: ModelConfig) -> bool:
        """Whether ``config`` was read from one of its entries, so that the format's refusals,
        warm-up and label apply to the model (a config this format reads may still be served by
        another's runner, as Triton's ONNX models are by nograd's)."""
        ...

    def serves(self, config: ModelConfig) -> bool:
        """Whether its runner builds the model of ``config`` (one it read, or one read into its
        kind by another format)."""
        ...

    def label(self, config: ModelConfig) -> str:
        """What a model of this format was served from, as the start-up summary names it."""
        ...


@runtime_checkable
class FolderFormat(Format, Protocol):
    """A format whose model is a folder of the repository, read through this (an archive, a
    file, is read by its own format's store instead)."""

    def read(
        self, folder: Path, override: Override | None, versions: Collection[str] | None
    ) -> ModelSource:
        """The model in ``folder``: the versions its policy selects, or those of ``versions``
        found on disk, each read with the load call's ``override``
        (``nograd.formats.source.shared_config_source`` reads a folder whose numbered version
        folders share one config); ``ConfigError`` names the file and the field."""
        ...


class UnknownFormat(LookupError):
    """A row whose object is not a format, or a config no format serves."""


@functools.cache
def every_format() -> tuple[Format, ...]:
    """Every format of the table, in its order, imported from the modules its rows name."""
    found = []
    for row in FORMATS:
        module_name, _, attribute = row.partition(":")
        candidate = getattr(importlib.import_module(module_name), attribute)
        if not isinstance(candidate, Format):
            raise UnknownFormat(f"{row} does not implement a model format")
        found.append(candidate)
    return tuple(found)


def format_of(entry: Path) -> Format | None:
    """The format of repository entry ``entry``; None when no format recognises it."""
    return next((fmt for fmt in every_format() if fmt.recognises(entry)), None)


def reading_format(config: ModelConfig) -> Format:
    """The format that read ``config``: whose refusals, warm-up and label apply to its model."""
    for fmt in every_format():
        if fmt.reads(config):
            return fmt
    raise UnknownFormat(f"model {config.name!r}: no format reads format {config.format!r}")


Warmup = Callable[..., None]
"""A format's warm-up, ``function(handler, model_dir)``: typed loosely, as this table knows no
handler (the runtime's)."""


@functools.cache
def format_warmup(row: str) -> Warmup:
    """The warm-up function row ``row`` (``Format.warmup``) names, imported on first use."""
    module_name, _, attribute = row.partition(":")
    return cast(Warmup, getattr(importlib.import_module(module_name), attribute))


def serving_format(config: ModelConfig) -> Format:
    """The format whose runner builds the model of ``config``."""
    for fmt in every_format():
        if fmt.serves(config):
            return fmt
    raise UnknownFormat(f"model {config.name!r}: no format serves format {config.format!r}")
