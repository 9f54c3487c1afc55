"""A request checked against its model's declared inputs before it is queued, so a bad input
fails only its own request."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import numpy as np

from nograd.core.datatypes import NUMPY_DTYPES, datatype_of, shape_matches
from nograd.core.finite import all_finite
from nograd.protocol.limits import tensor_decoded_bytes
from nograd.runtime.handler import Outputs, TensorPart
from nograd.runtime.runners import Handler
from nograd.schema.sequence_step import SequenceStep
from nograd.serving.calls import input_refusals as refusals
from nograd.serving.errors import InvalidInput, LimitExceeded
from nograd.serving.registry import ServedModel

INLINE_PREPARE_BYTES = 4096
"""Text a heavy ``prepare`` may handle on the event loop: tokenising this much takes less than
the hand-off to a thread and back costs in a busy server (measured in docs/architecture.md)."""


def add_batch_dimension(
    model: ServedModel, inputs: Mapping[str, np.ndarray]
) -> Mapping[str, np.ndarray]:
    """A model without a batch dimension (Triton's ``max_batch_size: 0``) gets its one sample as
    a batch of one row, as the batcher and handler take every request; unchanged otherwise."""
    if model.config.batch_dimension is not False:
        return inputs
    return {name: array[np.newaxis] for name, array in inputs.items()}


def remove_batch_dimension(model: ServedModel, outputs: Outputs) -> Outputs:
    """The outputs of a model without a batch dimension as it gives them: its one row."""
    if model.config.batch_dimension is not False:
        return outputs
    return {name: array[0] for name, array in outputs.items()}


def squeeze_scalar_samples(
    model: ServedModel, inputs: Mapping[str, np.ndarray]
) -> Mapping[str, np.ndarray]:
    """An input whose sample is a scalar, sent as ``[n, 1]``, as ``[n]``: Triton's convention for
    such an input is ``dims: [1]`` reshaped to ``[]``, so its clients and tools send the extra
    axis (the model configuration and metadata say so)."""
    scalar = {spec.name for spec in model.config.inputs if not spec.shape}
    if not any(
        name in scalar and array.ndim == 2 and array.shape[1] == 1 for name, array in inputs.items()
    ):
        return inputs
    return {
        name: array.reshape(-1)
        if name in scalar and array.ndim == 2 and array.shape[1] == 1
        else array
        for name, array in inputs.items()
    }


Declared = Mapping[str, tuple[str, tuple[int, ...]]]
"""A request's inputs as their headers declare them: name -> (datatype, shape), no data read."""


def decoded_bytes(declared: Declared) -> int:
    """Memory the declared tensors take once built, texts aside (a BYTES element counts its
    object): known before any is built, so a request over ``max_decoded_bytes`` costs none."""
    return sum(
        tensor_decoded_bytes(datatype, shape, NUMPY_DTYPES[datatype].itemsize)
        for datatype, shape in declared.values()
    )


def triton_batch_refusal(model: ServedModel, rows: int, request_id: str | None) -> str | None:
    """Triton's refusal of a request with more rows than a model's ``max_batch_size``, word for
    word (its clients and tests match the text), for a format that refuses them (Triton's); None
    when the rows fit or the model's format splits such requests across batches (nograd's)."""
    config = model.config
    if not model.format.refuses_rows_over_batch_limit or not config.batch_dimension:
        return None
    cap = config.max_batch_size
    if cap is None or rows <= cap:
        return None
    return (
        f"[request id: {request_id or '<id_unknown>'}] inference request batch-size must be "
        f"<= {cap} for '{model.name}'"
    )


def check_declared(
    model: ServedModel, declared: Declared, *, max_rows: int, request_id: str | None = None
) -> None:
    """Names, datatypes, per-sample shapes and row counts against the model's config, from what
    the inputs declare alone: gRPC runs it before decoding any data, so a request over the
    limits (at most ``max_rows`` rows of the declared per-sample shape) costs no decoding, and
    ``validate`` runs it on every front's arrays, so both fronts refuse with one check.
    ``request_id`` is the protocol's own id (the V2 ``id``), which Triton's refusals quote."""
    specs = {spec.name: spec for spec in model.config.inputs}
    required = [spec.name for spec in model.config.inputs if not spec.optional]
    missing = [name for name in required if name not in declared]
    if (
        len(declared) > len(specs)
        or len(declared) < len(required)
        or (missing and not set(declared) - set(specs))
    ):
        raise InvalidInput(refusals.input_count(model, list(declared), missing, request_id))
    unknown = [name for name in declared if name not in specs]
    if unknown:
        raise InvalidInput(refusals.unexpected_input(model, unknown[0]))
    if not declared:
        raise InvalidInput(
            f"the request carries no input for model {model.name!r} (its optional inputs: "
            f"{sorted(specs)}; send at least one)"
        )
    rows: set[int] = set()
    unbatched = model.config.batch_dimension is False
    for name, (datatype, shape) in declared.items():
        spec = specs[name]
        if datatype != spec.datatype:
            raise InvalidInput(refusals.datatype(model, name, datatype, spec, request_id))
        if unbatched:
            # No batch dimension (Triton's max_batch_size 0): the request is one sample.
            if not shape_matches(spec.shape, shape):
                raise InvalidInput(refusals.shape(model, name, shape, spec, request_id))
            continue
        sample = shape[1:]
        if not spec.shape and sample == (1,):  # Triton's extra axis (``squeeze_scalar_samples``)
            sample = ()
        if not shape or not shape_matches(spec.shape, sample):
            raise InvalidInput(refusals.shape(model, name, shape, spec, request_id))
        refusal = triton_batch_refusal(model, shape[0], request_id)
        if refusal is not None:
            raise InvalidInput(refusal)
        if shape[0] > max_rows:
            raise LimitExceeded(
                f"input {name!r} has {shape[0]} rows, more than the limit of {max_rows} "
                "(NOGRAD_MAX_REQUEST_ROWS)"
            )
        rows.add(shape[0])
    if unbatched:
        return
    if len(rows) != 1:
        raise InvalidInput(f"inputs disagree on the batch dimension: {sorted(rows)}")
    if 0 in rows:
        raise InvalidInput("inputs have zero rows")


def validate(
    model: ServedModel,
    inputs: Mapping[str, np.ndarray],
    *,
    max_rows: int,
    max_text_bytes: int,
    request_id: str | None = None,
    declared_checked: bool = False,
) -> None:
    """``check_declared`` on the arrays (unless ``declared_checked``: it passed on what the
    request declared, before the arrays were decoded to match), text lengths within
    ``max_text_bytes``, and floating-point values finite unless the model's
    ``reject_non_finite`` is off."""
    if not declared_checked:
        check_declared(
            model,
            {name: (datatype_of(array), tuple(array.shape)) for name, array in inputs.items()},
            max_rows=max_rows,
            request_id=request_id,
        )
    for name, array in inputs.items():
        if datatype_of(array) == "BYTES":
            _check_text_lengths(name, array, max_text_bytes)
    if model.config.reject_non_finite:
        # Last, once the request is known to be within its limits: the one check that reads
        # every value.
        for name, array in inputs.items():
            if array.dtype.kind == "f" and not all_finite(array):
                raise InvalidInput(_non_finite_message(model.name, name, array))


def _check_text_lengths(name: str, array: np.ndarray, limit: int) -> None:
    # Text and bytes only: a TorchServe front's request object is sized by the body limit.
    longest = max(
        (len(item) for item in array.reshape(-1) if isinstance(item, str | bytes)), default=0
    )
    if longest > limit:
        raise LimitExceeded(
            f"input {name!r} has an element of {longest} bytes; the limit is {limit} bytes "
            "(NOGRAD_MAX_TEXT_BYTES)"
        )


def _non_finite_message(model: str, name: str, array: np.ndarray) -> str:
    # Only a refused request gets here: counting and locating cost a second pass, the common
    # (all finite) case pays for the one ``isfinite`` pass alone.
    bad = ~np.isfinite(array)
    count = int(np.count_nonzero(bad))
    first = np.unravel_index(int(np.argmax(bad)), array.shape)
    index = [int(i) for i in first]
    return (
        f"input {name!r} holds {count} non-finite value{'s' if count != 1 else ''} "
        f"(NaN or +/-Inf), the first {array[tuple(index)]} at index {index}; model {model!r} "
        "refuses them (reject_non_finite = false in its config passes them on)"
    )


def prepare_in_thread(handler: Handler, inputs: Mapping[str, np.ndarray]) -> bool:
    """True when ``handler.prepare`` is heavy and this request's text exceeds the inline budget."""
    if not handler.prepare_offload:
        return False
    total = 0
    for array in inputs.values():
        # Text is counted value by value, stopping as soon as the budget is passed.
        sizes = (
            (len(v) if isinstance(v, (bytes, str)) else INLINE_PREPARE_BYTES for v in array.flat)
            if array.dtype == np.object_
            else (array.nbytes,)
        )
        for size in sizes:
            total += size
            if total > INLINE_PREPARE_BYTES:
                return True
    return False


async def prepared_part(
    model: ServedModel, inputs: Mapping[str, np.ndarray], sequence: SequenceStep | None
) -> TensorPart:
    """A validated request as the part its model's handler prepares for the batcher: with its
    sequence's control and state tensors, and a batch dimension when the model has none; a
    handler's refusal (``ValueError``) is the client's 400."""
    assert model.handler is not None
    if sequence is not None:
        inputs = {**inputs, **sequence.tensors}
    inputs = add_batch_dimension(model, inputs)
    try:
        if prepare_in_thread(model.handler, inputs):
            # Tokenising or decoding a large request costs milliseconds: off the event loop.
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, model.handler.prepare, inputs)
        return model.handler.prepare(inputs)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc
