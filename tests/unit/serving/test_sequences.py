"""A sequence model's requests in the serving core: the sequence parameters checked, each request
fed its controls and its sequence's state, the state kept and never answered, and Triton's
refusals word for word."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from nograd.formats.triton.reading.config import read_triton
from nograd.schema.sequence_step import FLAG_END, FLAG_START, SequenceStep
from nograd.serving.errors import InvalidInput
from nograd.serving.extensions.sequences import (
    NO_SEQUENCE,
    SequenceRequest,
    Sequences,
    refuse_sequence,
    sequence_request,
)
from nograd.serving.registry import ServedModel
from tests.unit.formats.triton.test_triton_sequences import ACCUMULATOR


@pytest.fixture
def model(tmp_path: Path) -> ServedModel:
    folder = tmp_path / "acc"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(ACCUMULATOR)
    return ServedModel(config=read_triton(folder), directory=folder / "1")


class Accumulator:
    """The model as the batcher would run it: a sum over the state, the steps it saw."""

    def __init__(self, model: ServedModel) -> None:
        self.model = model
        self.steps: list[SequenceStep] = []

    def __call__(self, inputs: dict[str, np.ndarray]) -> object:
        async def run(step: SequenceStep) -> tuple[ServedModel, dict[str, np.ndarray]]:
            self.steps.append(step)
            tensors = step.tensors
            start = tensors["START"].astype(bool)
            total = np.where(start, inputs["INPUT"], tensors["INPUT_STATE"] + inputs["INPUT"])
            return self.model, {"OUTPUT": total, "OUTPUT_STATE": total}

        return run


def _rows(value: int) -> dict[str, np.ndarray]:
    return {"INPUT": np.array([[value]], np.int32)}


async def test_a_sequence_accumulates_in_its_state_and_its_controls_say_where_it_is(
    model: ServedModel,
) -> None:
    sequences = Sequences(max_sequences=8)
    accumulator = Accumulator(model)
    answers = []
    for value, start, end in ((5, True, False), (3, False, False), (2, False, True)):
        inputs = _rows(value)
        request = SequenceRequest(42, start, end)
        _, outputs = await sequences.infer(model, request, inputs, accumulator(inputs))  # type: ignore[arg-type]
        assert set(outputs) == {"OUTPUT"}  # the state is kept, never answered
        answers.append(int(outputs["OUTPUT"][0, 0]))
    assert answers == [5, 8, 10]
    first, _, last = accumulator.steps
    assert (first.flags, last.flags) == (FLAG_START, FLAG_END)
    assert first.tensors["CORRID"].dtype == np.uint64 and int(first.tensors["CORRID"][0, 0]) == 42
    assert first.tensors["END"].tolist() == [[False]] and last.tensors["END"].tolist() == [[True]]
    assert first.tensors["INPUT_STATE"].tolist() == [[0]]  # zeros at the start
    with pytest.raises(InvalidInput) as refused:  # ended: its id is unknown again
        await sequences.infer(model, SequenceRequest(42), _rows(1), accumulator(_rows(1)))  # type: ignore[arg-type]
    assert str(refused.value) == (
        "inference request for sequence 42 to model 'acc' must specify the START flag on the "
        "first request of the sequence"
    )


async def test_requests_without_an_id_or_with_a_string_id_for_an_integer_corrid(
    model: ServedModel,
) -> None:
    sequences = Sequences(max_sequences=8)
    run = Accumulator(model)(_rows(1))
    with pytest.raises(InvalidInput) as refused:
        await sequences.infer(model, SequenceRequest(0, True), _rows(1), run)  # type: ignore[arg-type]
    assert str(refused.value) == (
        "inference request to model 'acc' must specify a non-zero or non-empty correlation ID"
    )
    with pytest.raises(InvalidInput, match="CORRID control 'CORRID' is UINT64"):
        await sequences.infer(model, SequenceRequest("abc", True), _rows(1), run)  # type: ignore[arg-type]


async def test_a_request_of_more_than_one_row_is_refused_as_triton_refuses_it(
    model: ServedModel,
) -> None:
    sequences = Sequences(max_sequences=8)
    inputs = {"INPUT": np.array([[1], [2]], np.int32)}
    with pytest.raises(InvalidInput) as refused:
        await sequences.infer(model, SequenceRequest(7, True), inputs, Accumulator(model)(inputs))  # type: ignore[arg-type]
    assert str(refused.value) == (
        "inference request to model 'acc' must specify batch-size 1 due to requirements of "
        "sequence batcher"
    )
    assert 7 not in sequences.book(model)  # refused before it started a sequence


async def test_an_idle_sequence_is_released_on_a_timer_without_another_request(
    model: ServedModel,
) -> None:
    """The model (idle time 0.25 s) gets no further request: its sequence's state is still
    released, and its empty book forgotten, by the periodic look rather than held until a next
    request comes."""
    sequences = Sequences(max_sequences=8)
    await sequences.infer(model, SequenceRequest(42, True), _rows(5), Accumulator(model)(_rows(5)))  # type: ignore[arg-type]
    sweeper = asyncio.create_task(sequences.release_idle_forever())
    try:
        await asyncio.sleep(0.1)
        assert sequences.held == 1  # not idle long enough yet
        for _ in range(200):  # 10 s at most
            if not sequences.held:
                break
            await asyncio.sleep(0.05)
        assert sequences.held == 0
        assert sequences.release_idle() == 0  # nothing left to release, no book kept
    finally:
        sweeper.cancel()
    with pytest.raises(InvalidInput, match="must specify the START flag"):
        await sequences.infer(model, SequenceRequest(42), _rows(1), Accumulator(model)(_rows(1)))  # type: ignore[arg-type]


def test_sequence_parameters_are_checked() -> None:
    assert sequence_request({}) == SequenceRequest()
    # A request naming no sequence shares one value, which no model refuses.
    assert sequence_request({"binary_data_output": True}) is NO_SEQUENCE
    refuse_sequence("plain", NO_SEQUENCE)
    with pytest.raises(InvalidInput, match="not a sequence model"):
        refuse_sequence("plain", sequence_request({"sequence_start": True}))
    given = {"sequence_id": "u-1", "sequence_start": True, "sequence_end": False}
    assert sequence_request(given) == SequenceRequest("u-1", True, False)
    for bad in ({"sequence_id": 1.5}, {"sequence_id": True}, {"sequence_id": -1}):
        with pytest.raises(InvalidInput, match="sequence_id"):
            sequence_request(bad)
    with pytest.raises(InvalidInput, match="'sequence_end' must be a boolean"):
        sequence_request({"sequence_end": 1})


async def test_a_string_id_over_the_bound_is_refused_before_it_is_kept(
    model: ServedModel,
) -> None:
    """A string id is kept as long as its sequence: one longer than the bound is refused (400
    naming the bound and the setting) before a book keeps it (a stream takes no place for it),
    and the refusal quotes only its start; an integer id past uint64 is refused as Triton's
    type."""
    sequences = Sequences(max_sequences=8, max_id_bytes=16)
    run = Accumulator(model)(_rows(1))
    sequences.check_id(SequenceRequest("x" * 16))  # at the bound: taken
    await sequences.infer(model, SequenceRequest(5, True), _rows(1), run)  # type: ignore[arg-type]
    for huge in ("y" * (3 << 20), "é" * 9):  # 3 MiB; 9 characters but 18 bytes
        with pytest.raises(InvalidInput) as refused:
            await sequences.infer(model, SequenceRequest(huge, True), _rows(1), run)  # type: ignore[arg-type]
        message = str(refused.value)
        assert "longer than the 16 bytes" in message
        assert "NOGRAD_MAX_SEQUENCE_ID_BYTES" in message
        assert len(message) < 300
        assert sequences.take_place(model, SequenceRequest(huge)) is None  # refused when run
    assert sequences.held == 1
    with pytest.raises(InvalidInput, match="uint64") as refused:
        sequence_request({"sequence_id": 2**64})
    sequence_request({"sequence_id": 2**64 - 1})
    with pytest.raises(InvalidInput) as refused:
        sequence_request({"sequence_id": [0] * 1_000_000})
    assert len(str(refused.value)) < 300
    with pytest.raises(InvalidInput) as refused:
        sequence_request({"sequence_start": "z" * 1_000_000})
    assert len(str(refused.value)) < 300


def test_a_model_without_sequences_refuses_a_request_naming_one() -> None:
    refuse_sequence("simple", SequenceRequest())
    with pytest.raises(InvalidInput) as refused:
        refuse_sequence("simple", SequenceRequest(5, True))
    assert "sequence_id, sequence_start cannot be honoured" in str(refused.value)
