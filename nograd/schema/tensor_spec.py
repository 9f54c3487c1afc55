"""One input or output of a model, as its config lists it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nograd.core.datatypes import Datatype


class TensorSpec(BaseModel):
    """One input or output, per sample: the batch dimension is implicit and not listed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    datatype: Datatype
    shape: tuple[int, ...]
    """Per-sample shape; -1 marks a variable dimension (padded when batched)."""
    reshape: tuple[int, ...] | None = None
    """The shape the model itself takes (or gives, for an output) per sample, when it differs
    from ``shape``, the one requests carry (Triton's ``reshape``); same number of elements."""
    optional: bool = False
    """An input a request may leave out (Triton's ``optional``; Python-backend models only)."""
    labels: tuple[str, ...] = ()
    """A classifier output's class names by index (Triton's ``label_filename``, read at load),
    which the classification extension appends to its ``score:index`` answers."""

    @field_validator("shape", "reshape")
    @classmethod
    def _dims_valid(cls, shape: tuple[int, ...] | None) -> tuple[int, ...] | None:
        for dim in shape or ():
            if dim == 0 or dim < -1:
                dims = list(shape or ())
                raise ValueError(f"dimension {dim} in shape {dims} must be positive or -1")
        return shape
