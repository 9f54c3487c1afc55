"""A sequence model's declaration (Triton's ``sequence_batching``): the control tensors the server
feeds it with each request of a sequence, and the implicit state it keeps for each sequence."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from nograd.schema.tensor_spec import TensorSpec

ControlKind = Literal["start", "end", "ready", "corrid"]


class SequenceControl(BaseModel):
    """One control input: ``false``/``true`` are what a START, END or READY input carries
    (Triton's ``int32_false_true``, ``fp32_false_true``, ``bool_false_true``); a CORRID input
    carries the sequence's id in ``datatype``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: ControlKind
    datatype: str
    false: float | int | bool = 0
    true: float | int | bool = 1


class SequenceState(BaseModel):
    """One implicit state: the model reads ``input_name`` and writes ``output_name``; the server
    keeps the output of one request of a sequence as the input of the next, and starts each
    sequence from zeros of ``shape`` (per row, without the batch dimension)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input_name: str
    output_name: str
    datatype: str
    shape: tuple[int, ...]


class SequenceBatching(BaseModel):
    """Requests naming a sequence run in order, one at a time per sequence; different sequences'
    requests batch together."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Literal["direct", "oldest"] = "direct"
    idle_s: float = Field(default=1.0, gt=0.0)
    """A sequence that receives no request for this long is released (Triton's
    ``max_sequence_idle_microseconds``)."""
    controls: tuple[SequenceControl, ...] = ()
    states: tuple[SequenceState, ...] = ()

    @property
    def hidden_inputs(self) -> frozenset[str]:
        """Inputs the server feeds, never a client: the controls and the states read."""
        return frozenset(
            [control.name for control in self.controls]
            + [state.input_name for state in self.states]
        )


def hidden_inputs(sequence: SequenceBatching | None) -> tuple[TensorSpec, ...]:
    """The inputs a sequence model takes besides its declared ones: each control (one value per
    row) and each state read."""
    if sequence is None:
        return ()
    controls = [TensorSpec(name=c.name, datatype=c.datatype, shape=(1,)) for c in sequence.controls]
    states = [
        TensorSpec(name=s.input_name, datatype=s.datatype, shape=s.shape) for s in sequence.states
    ]
    return (*controls, *states)


def state_outputs(sequence: SequenceBatching | None) -> tuple[TensorSpec, ...]:
    """The outputs a sequence model writes besides its declared ones: each state written."""
    if sequence is None:
        return ()
    return tuple(
        TensorSpec(name=s.output_name, datatype=s.datatype, shape=s.shape) for s in sequence.states
    )
