"""One step of a Triton ensemble, as its config lists it: the model it runs and how the
ensemble's tensors map onto that model's inputs and outputs."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EnsembleStep(BaseModel):
    """``ensemble_scheduling.step``: ``model`` (Triton's ``model_name``) at ``version`` (None:
    Triton's ``-1``, the version a request without one goes to)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)
    version: str | None = None
    inputs: tuple[tuple[str, str], ...]
    """(the step model's input, the ensemble tensor it takes), Triton's ``input_map``."""
    outputs: tuple[tuple[str, str], ...]
    """(the step model's output, the ensemble tensor it gives), Triton's ``output_map``."""
