"""Triton's ``sequence_batching`` block read into nograd's ``SequenceBatching``, and completed as
Triton completes it, so the configuration nograd reports is the one Triton reports."""

from __future__ import annotations

from typing import Any, Final

from nograd.core.datatypes import TABLE
from nograd.formats.triton.reading.generated import model_config_pb2 as pb
from nograd.schema.sequence_config import (
    ControlKind,
    SequenceBatching,
    SequenceControl,
    SequenceState,
)

IDLE_DEFAULT_US: Final = 1_000_000
"""Triton's ``max_sequence_idle_microseconds`` when a config leaves it unset."""
KINDS: Final[dict[int, ControlKind]] = {
    pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_START: "start",
    pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_END: "end",
    pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_READY: "ready",
    pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_CORRID: "corrid",
}
CORRID_TYPES: Final = frozenset({"UINT64", "INT64", "UINT32", "INT32", "BYTES"})
DATATYPES: Final[dict[str, str]] = {row.triton: row.name for row in TABLE}


def sequence_batching(message: Any) -> SequenceBatching:
    """The model's ``sequence_batching`` (the message completed in place as Triton 2.51 completes
    it: the idle time, and the oldest strategy's preferred batch size; a block naming no strategy
    is reported without one, and served as direct); a ``ValueError`` names the field nograd
    cannot honour."""
    block = message.sequence_batching
    if block.iterative_sequence:
        raise ValueError("field 'sequence_batching.iterative_sequence' is not supported by nograd")
    if not block.max_sequence_idle_microseconds:
        block.max_sequence_idle_microseconds = IDLE_DEFAULT_US
    oldest = block.HasField("oldest") and not block.oldest.preferred_batch_size
    if oldest and message.max_batch_size > 0:
        block.oldest.preferred_batch_size.append(message.max_batch_size)
    controls = tuple(
        _control(entry.name, control) for entry in block.control_input for control in entry.control
    )
    kinds = [control.kind for control in controls]
    repeated = sorted({kind for kind in kinds if kinds.count(kind) > 1})
    if repeated:
        raise ValueError(f"field 'sequence_batching.control_input': {repeated[0]} given twice")
    return SequenceBatching(
        strategy="oldest" if block.HasField("oldest") else "direct",
        idle_s=block.max_sequence_idle_microseconds / 1e6,
        controls=controls,
        states=tuple(_state(state) for state in block.state),
    )


def queue_delay_ms(message: Any) -> float:
    """The strategy's ``max_queue_delay_microseconds``, in ms: how long a batch waits for other
    sequences' requests."""
    block = message.sequence_batching
    strategy = block.oldest if block.HasField("oldest") else block.direct
    return float(strategy.max_queue_delay_microseconds / 1000)


def _control(name: str, control: Any) -> SequenceControl:
    label = f"field 'sequence_batching.control_input' {name!r}"
    kind = KINDS[control.kind]
    if kind == "corrid":
        datatype = DATATYPES.get(pb.DataType.Name(control.data_type), "")
        if datatype not in CORRID_TYPES:
            raise ValueError(
                f"{label}: a CORRID control's data_type must be TYPE_UINT64, TYPE_INT64, "
                "TYPE_UINT32, TYPE_INT32 or TYPE_STRING"
            )
        return SequenceControl(name=name, kind=kind, datatype=datatype)
    for field, datatype in (
        ("int32_false_true", "INT32"),
        ("fp32_false_true", "FP32"),
        ("bool_false_true", "BOOL"),
    ):
        values = list(getattr(control, field))
        if values:
            if len(values) != 2:
                raise ValueError(f"{label}: {field!r} holds two values, false then true")
            return SequenceControl(
                name=name, kind=kind, datatype=datatype, false=values[0], true=values[1]
            )
    raise ValueError(
        f"{label}: a {kind.upper()} control needs int32_false_true, fp32_false_true or "
        "bool_false_true"
    )


def _state(state: Any) -> SequenceState:
    label = f"field 'sequence_batching.state' {state.input_name!r}"
    datatype = DATATYPES.get(pb.DataType.Name(state.data_type))
    if datatype is None or datatype == "BYTES":
        raise ValueError(f"{label}: its data_type is not served by nograd for implicit state")
    shape = tuple(int(d) for d in state.dims)
    if any(d < 0 for d in shape):
        raise ValueError(f"{label}: nograd keeps implicit state of fixed dims only")
    for initial in state.initial_state:
        if initial.HasField("data_file") or not initial.zero_data:
            raise ValueError(f"{label}: nograd starts implicit state from zeros only")
    if not state.input_name or not state.output_name:
        raise ValueError(f"{label}: a state names its input_name and output_name")
    return SequenceState(
        input_name=state.input_name, output_name=state.output_name, datatype=datatype, shape=shape
    )
