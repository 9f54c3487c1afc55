"""Refusals of a request's inputs in Triton's words, for every model and both fronts: Triton's
clients, tests and scripts match on this text, so a server taking their requests words its
refusals as Triton does."""

from __future__ import annotations

from collections.abc import Sequence

from nograd.schema.config import TensorSpec
from nograd.serving.registry import ServedModel


def request_label(request_id: str | None) -> str:
    return f"[request id: {request_id or '<id_unknown>'}] "


def _names(names: Sequence[str]) -> str:
    # Triton builds "['A','B']" and drops the last character before closing it: with no names
    # left that is the opening bracket, so an empty list reads "]".
    return "[" + ",".join(f"'{name}'" for name in names) + "]" if names else "]"


def input_count(
    model: ServedModel, given: Sequence[str], missing: Sequence[str], request_id: str | None
) -> str:
    """More inputs than the model has, or fewer than it requires."""
    specs = model.config.inputs
    required = sum(not spec.optional for spec in specs)
    expected = (
        f"{len(specs)} inputs"
        if required == len(specs)
        else f"number of inputs between {required} and {len(specs)}"
    )
    got = _names(given) if given else "[]"
    return (
        f"{request_label(request_id)}expected {expected} but got {len(given)} inputs for model "
        f"'{model.name}'. Got input(s) {got}, but missing required input(s) {_names(missing)}. "
        "Please provide all required input(s)."
    )


def unexpected_input(model: ServedModel, name: str) -> str:
    return f"unexpected inference input '{name}' for model '{model.name}'"


def datatype(
    model: ServedModel, name: str, given: str, spec: TensorSpec, request_id: str | None
) -> str:
    return (
        f"{request_label(request_id)}inference input '{name}' data-type is '{given}', but model "
        f"'{model.name}' expects '{spec.datatype}'"
    )


def shape(
    model: ServedModel, name: str, given: Sequence[int], spec: TensorSpec, request_id: str | None
) -> str:
    """The shape the model takes, batch dimension first (-1) where it has one, and the one sent."""
    batched = model.config.batch_dimension is not False
    expected = [-1, *spec.shape] if batched else list(spec.shape)
    note = model.format.shape_refusal_note if batched else ""

    def dims(values: Sequence[int]) -> str:
        return "[" + ",".join(str(v) for v in values) + "]"

    return (
        f"{request_label(request_id)}unexpected shape for input '{name}' for model "
        f"'{model.name}'. Expected {dims(expected)}, got {dims(given)}. {note}"
    )
