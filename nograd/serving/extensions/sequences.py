"""Requests of a sequence model (Triton's ``sequence_batching``), whatever front they came by:
the request's ``sequence_id``, ``sequence_start`` and ``sequence_end`` checked as Triton checks
them, the request run as its sequence's next (``nograd.batching.sequences``), fed the control
inputs its model declares (START, END, READY, CORRID) and its sequence's implicit state, whose new
value is kept for the next request and never answered to the client.

A model without ``sequence_batching`` refuses a request that names a sequence: answering it as if
it had not would lose the state its client counts on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Final

import numpy as np

from nograd.batching.sequences import Place as Place  # the fronts take it from here
from nograd.batching.sequences import Sequence, SequenceBook, UnknownSequence
from nograd.core.datatypes import NUMPY_DTYPES
from nograd.runtime.handler import Outputs
from nograd.schema.sequence_config import SequenceBatching, SequenceControl
from nograd.schema.sequence_step import FLAG_END, FLAG_START, SequenceStep
from nograd.serving.errors import InvalidInput
from nograd.serving.registry import ServedModel

SEQUENCE_PARAMETERS: Final = ("sequence_id", "sequence_start", "sequence_end")
CHECK_IDLE_S: Final = 1.0
"""The longest wait between two looks for idle sequences; a model with a shorter idle time is
looked at every idle time."""
SHORTEST_CHECK_S: Final = 0.05
LARGEST_INTEGER_ID: Final = 2**64 - 1
"""Triton's correlation ids are uint64: a larger integer is refused, not kept as a key."""
SHOWN_CHARS: Final = 64
"""How much of a refused value an error quotes: never a client's whole (perhaps huge) value."""
SequenceId = int | str
Run = Callable[[SequenceStep], Awaitable[tuple[ServedModel, Outputs]]]
"""One inference of the request with its sequence's tensors added."""


@dataclass(frozen=True)
class SequenceRequest:
    """What a request says of its sequence: its id (0 or "" for none) and flags."""

    id: SequenceId = 0
    start: bool = False
    end: bool = False

    @property
    def named(self) -> list[str]:
        """The sequence parameters the request set."""
        values = (self.id, self.start, self.end)
        return [key for key, value in zip(SEQUENCE_PARAMETERS, values, strict=True) if value]


NO_SEQUENCE: Final = SequenceRequest()
"""A request that names no sequence: most requests, sharing one value."""


def sequence_request(parameters: Mapping[str, object]) -> SequenceRequest:
    """The sequence parameters among a request's ``parameters``; an id must be an integer from
    0 to 2^64-1 (Triton's uint64) or a string, the flags booleans. A string id's length is
    checked by ``Sequences``, which knows the bound."""
    if not parameters or not any(key in parameters for key in SEQUENCE_PARAMETERS):
        return NO_SEQUENCE
    given_id = parameters.get("sequence_id", 0)
    if isinstance(given_id, bool) or not isinstance(given_id, int | str):
        raise InvalidInput(
            f"parameter 'sequence_id' must be an integer or a string, got {shown(given_id)}"
        )
    if isinstance(given_id, int) and not 0 <= given_id <= LARGEST_INTEGER_ID:
        raise InvalidInput(
            f"parameter 'sequence_id' must be an integer from 0 to {LARGEST_INTEGER_ID} "
            f"(uint64), got {shown(given_id)}"
        )
    flags = []
    for key in SEQUENCE_PARAMETERS[1:]:
        value = parameters.get(key, False)
        if not isinstance(value, bool):
            raise InvalidInput(f"parameter {key!r} must be a boolean, got {shown(value)}")
        flags.append(value)
    return SequenceRequest(given_id, flags[0], flags[1])


def shown(value: object) -> str:
    """``value`` as an error quotes it: its repr, cut to ``SHOWN_CHARS`` characters (the rest
    counted), so a refusal never sends a client's huge value back whole."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, str) and len(value) > SHOWN_CHARS:
        return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"
    if isinstance(value, list | dict) and len(value) > SHOWN_CHARS:
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value)
    if len(text) > SHOWN_CHARS:
        return f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"
    return text


def refuse_sequence(model: str, request: SequenceRequest) -> None:
    """A request naming a sequence to a model that declares none: a 400 naming what it asked."""
    if request is not NO_SEQUENCE and request.named:
        raise InvalidInput(
            f"model '{model}' is not a sequence model (its configuration has no "
            f"sequence_batching): the request's {', '.join(request.named)} cannot be honoured"
        )


class Sequences:
    """The sequences under way of every sequence model, one book per model version."""

    def __init__(self, max_sequences: int, max_id_bytes: int = 256) -> None:
        self.max_sequences = max_sequences
        self.max_id_bytes = max_id_bytes
        """Longest string sequence id taken (``NOGRAD_MAX_SEQUENCE_ID_BYTES``): an id is kept as
        long as its sequence is, so its size is held for every place a client takes."""
        self._books: dict[tuple[str, str], SequenceBook] = {}

    def check_id(self, request: SequenceRequest) -> None:
        """Refuse (400 naming the bound) a string id longer than ``max_id_bytes`` in UTF-8,
        before any book keeps it; the refusal quotes only its start."""
        if not self._id_fits(request):
            raise InvalidInput(
                f"parameter 'sequence_id' is longer than the {self.max_id_bytes} bytes a "
                f"sequence id may have (NOGRAD_MAX_SEQUENCE_ID_BYTES): got {shown(request.id)}"
            )

    def _id_fits(self, request: SequenceRequest) -> bool:
        given = request.id
        # More characters than the bound is more bytes too: a huge id is never encoded.
        return not isinstance(given, str) or (
            len(given) <= self.max_id_bytes and len(given.encode()) <= self.max_id_bytes
        )

    def book(self, model: ServedModel) -> SequenceBook:
        sequence = model.config.sequence
        assert sequence is not None
        key = (model.name, model.version)
        book = self._books.get(key)
        if book is None or book.idle_s != sequence.idle_s:
            book = self._books[key] = SequenceBook(sequence.idle_s, self.max_sequences)
        return book

    @property
    def held(self) -> int:
        """Sequences held now, of every model, idle ones not yet released included."""
        return sum(book.held for book in self._books.values())

    def release_idle(self) -> int:
        """Release every sequence idle for longer than its model's idle time, and forget the
        books left empty (an unloaded model's included); how many sequences were released."""
        released = 0
        for key, book in list(self._books.items()):
            released += book.release_idle()
            if book.empty:
                del self._books[key]
        return released

    async def release_idle_forever(self) -> None:
        """``release_idle`` on a timer, so a model that receives no more requests does not keep
        its idle sequences' state until its next one: a sequence is released within about
        twice its idle time (for a model's first sequence, at most ``CHECK_IDLE_S`` later)."""
        while True:
            idle = min((book.idle_s for book in self._books.values()), default=CHECK_IDLE_S)
            await asyncio.sleep(max(SHORTEST_CHECK_S, min(idle, CHECK_IDLE_S)))
            self.release_idle()

    def take_place(self, model: ServedModel, request: SequenceRequest) -> Place | None:
        """A place for ``request`` among its sequence's requests, in the order it arrived, for
        a front that reads requests before serving them side by side (a gRPC stream); None
        where the model or the request has no sequence. Given up with ``Place.leave``."""
        if model.config.sequence is None or not request.id or not self._id_fits(request):
            return None  # an id over the bound takes no place: ``infer`` refuses it
        return self.book(model).take_place(request.id)

    async def infer(
        self,
        model: ServedModel,
        request: SequenceRequest,
        inputs: Mapping[str, np.ndarray],
        run: Run,
        place: Place | None = None,
    ) -> tuple[ServedModel, Outputs]:
        """``run`` the request as its sequence's next; Triton's refusals, word for word, of a
        request with no sequence id, of one of more than one row, and of one continuing a
        sequence not under way."""
        sequence = model.config.sequence
        assert sequence is not None
        if not request.id:
            raise InvalidInput(
                f"inference request to model '{model.name}' must specify a non-zero or "
                "non-empty correlation ID"
            )
        self.check_id(request)

        batched = model.config.batch_dimension is not False
        if batched and inputs and len(next(iter(inputs.values()))) != 1:
            raise InvalidInput(
                f"inference request to model '{model.name}' must specify batch-size 1 due to "
                "requirements of sequence batcher"
            )

        async def step(under_way: Sequence) -> tuple[ServedModel, Outputs]:
            tensors = _tensors(model, sequence, request, under_way)
            flags = (FLAG_START if request.start else 0) | (FLAG_END if request.end else 0)
            served, outputs = await run(SequenceStep(request.id, flags, tensors))
            kept = {state.output_name for state in sequence.states}
            for state in sequence.states:
                under_way.state[state.input_name] = outputs[state.output_name]
            return served, {name: array for name, array in outputs.items() if name not in kept}

        try:
            book = self.book(model)
            return await book.run(request.id, request.start, request.end, step, place)
        except UnknownSequence:
            raise InvalidInput(
                f"inference request for sequence {request.id} to model '{model.name}' must "
                "specify the START flag on the first request of the sequence"
            ) from None


def _tensors(
    model: ServedModel, sequence: SequenceBatching, request: SequenceRequest, under_way: Sequence
) -> dict[str, np.ndarray]:
    """The controls and states of one request: one row (a model without a batch dimension: one
    value)."""
    lead = (1,) if model.config.batch_dimension is not False else ()
    tensors = {
        control.name: _control(control, request, (*lead, 1)) for control in sequence.controls
    }
    for state in sequence.states:
        kept = under_way.state.get(state.input_name)
        if kept is None:
            kept = np.zeros((*lead, *state.shape), NUMPY_DTYPES[state.datatype])
        tensors[state.input_name] = kept
    return tensors


def _control(
    control: SequenceControl, request: SequenceRequest, shape: tuple[int, ...]
) -> np.ndarray:
    if control.kind == "corrid":
        if control.datatype == "BYTES":
            return np.full(shape, str(request.id).encode(), dtype=np.object_)
        if not isinstance(request.id, int):
            raise InvalidInput(
                f"the model's CORRID control {control.name!r} is {control.datatype}: "
                f"parameter 'sequence_id' must be an integer, got {shown(request.id)}"
            )
        return np.full(shape, request.id, NUMPY_DTYPES[control.datatype])
    on = {"start": request.start, "end": request.end, "ready": True}[control.kind]
    return np.full(shape, control.true if on else control.false, NUMPY_DTYPES[control.datatype])
