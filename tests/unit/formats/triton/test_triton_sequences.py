"""Triton's ``sequence_batching`` read into nograd's config: controls, implicit state, the
strategy's queue delay, the block completed as Triton completes it, and what nograd refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nograd.formats.triton.reading.config import read_triton
from nograd.schema.config import ConfigError
from nograd.schema.sequence_config import SequenceControl, hidden_inputs, state_outputs
from tests.triton_models import FIXTURES

ACCUMULATOR = """
name: "acc"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  max_sequence_idle_microseconds: 250000
  oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 20000 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32
            dims: [ 1 ] initial_state { zero_data: true data_type: TYPE_INT32 dims: [ 1 ]
            name: "zeros" } } ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def _folder(tmp_path: Path, config: str) -> Path:
    folder = tmp_path / "acc"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(b"")
    (folder / "config.pbtxt").write_text(config)
    return folder


def test_triton_s_simple_sequence_declares_start_and_ready(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "simple_sequence", tmp_path / "simple_sequence")
    config = read_triton(tmp_path / "simple_sequence")
    assert config.sequence is not None
    assert config.sequence.controls == (
        SequenceControl(name="START", kind="start", datatype="INT32", false=0, true=1),
        SequenceControl(name="READY", kind="ready", datatype="INT32", false=0, true=1),
    )
    assert config.sequence.strategy == "direct" and config.sequence.idle_s == 1.0
    assert config.max_queue_delay_ms == 0.0
    assert [spec.name for spec in hidden_inputs(config.sequence)] == ["START", "READY"]
    # Reported as Triton 2.51 completes it: its default idle time, and no strategy added.
    reported = json.loads(config.triton_config or "{}")["sequence_batching"]
    assert reported["max_sequence_idle_microseconds"] == 1000000
    assert "direct" not in reported and "oldest" not in reported
    assert reported["control_input"][0]["name"] == "START"


def test_controls_state_and_the_oldest_strategy(tmp_path: Path) -> None:
    config = read_triton(_folder(tmp_path, ACCUMULATOR))
    sequence = config.sequence
    assert sequence is not None
    assert (sequence.strategy, sequence.idle_s) == ("oldest", 0.25)
    assert config.max_queue_delay_ms == 20.0
    kinds = [(c.name, c.kind, c.datatype) for c in sequence.controls]
    assert kinds == [
        ("START", "start", "INT32"),
        ("END", "end", "BOOL"),
        ("CORRID", "corrid", "UINT64"),
    ]
    assert [(s.name, s.shape) for s in hidden_inputs(sequence)][-1] == ("INPUT_STATE", (1,))
    assert [(s.name, s.datatype) for s in state_outputs(sequence)] == [("OUTPUT_STATE", "INT32")]
    # Clients see the declared tensors only.
    assert [s.name for s in config.inputs] == ["INPUT"]
    # Reported as Triton completes it: the oldest strategy prefers batches of max_batch_size.
    reported = json.loads(config.triton_config or "{}")["sequence_batching"]
    assert reported["oldest"]["preferred_batch_size"] == [8]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (("sequence_batching {", "sequence_batching { iterative_sequence: true"), "iterative"),
        (("data_type: TYPE_UINT64", "data_type: TYPE_FP32"), "CORRID control's data_type"),
        (("dims: [ 1 ] initial_state", "dims: [ -1 ] initial_state"), "fixed dims"),
        (("zero_data: true", 'data_file: "x"'), "from zeros"),
        (("bool_false_true: [ false, true ]", ""), "END control needs"),
    ],
)
def test_what_nograd_cannot_honour_is_refused_by_name(
    tmp_path: Path, change: tuple[str, str], named: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        read_triton(_folder(tmp_path, ACCUMULATOR.replace(*change)))
    assert named in str(refused.value)
    assert "sequence_batching" in str(refused.value) or "CONTROL" not in str(refused.value)
