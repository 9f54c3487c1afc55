"""Open Inference Protocol (KServe V2) tensors <-> numpy, with errors that name the problem.

JSON tensors here; tensors in the binary part of a body (the binary tensor data extension) are
decoded and encoded by ``nograd.protocol.binary`` and assembled here. Decoding is strict: a tensor
whose
data does not match its declared datatype or shape is a client error (400), never something numpy
silently casts or truncates.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import numpy as np
import orjson

from nograd.core.datatypes import NUMPY_DTYPES, datatype_of
from nograd.core.errors import DecodeError
from nograd.core.finite import all_finite
from nograd.protocol import binary, classification
from nograd.protocol import shared_memory as shm
from nograd.protocol.limits import MAX_DIMS, checked_shape

logger = logging.getLogger(__name__)

NON_FINITE_PARAMETER: Final = "non_finite"
"""Output parameter set on a JSON output holding NaN or +/-Inf; its value, ``"null"``, says what
they became (JSON has no such numbers). Binary outputs carry them as they are and are not marked."""
NON_FINITE_WARNING_INTERVAL_S: Final = 300.0
"""A model whose JSON outputs keep holding NaN or +/-Inf is warned about at most this often: a
line per response would flood the log of a server answering thousands a second."""
_NON_FINITE_TOKEN = re.compile(rb"-?(?:nan|inf)", re.IGNORECASE)


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool = False
    classification: int = 0
    """Classes to answer instead of the tensor (Triton's classification extension); 0: none."""
    placement: shm.Placement | None = None
    """Where to write it instead of the body (the system shared-memory extension)."""


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: tuple[RequestedOutput, ...]
    parameters: Mapping[str, Any]


_KINDS = {
    "BOOL": ("b",),
    "INT": ("i", "u"),
    "UINT": ("i", "u"),
    "FP": ("i", "u", "f"),
}


def parse_json(body: bytes | bytearray | memoryview) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        hint = ""
        if _is_non_finite_number(body, exc):
            hint = (
                "; JSON has no NaN or Infinity (nor numbers beyond a double's range): "
                "non-finite values travel only as binary tensor data"
            )
        raise DecodeError(f"malformed JSON: {exc}{hint}") from exc


def _is_non_finite_number(
    body: bytes | bytearray | memoryview, exc: orjson.JSONDecodeError
) -> bool:
    """True when the parser stopped at ``NaN``, ``Infinity`` (signed or not) or an overflow:
    the client most likely serialised a non-finite float (Python's json module does)."""
    if "infinity" in exc.msg:
        return True
    start = exc.pos - 1 if exc.pos > 0 and body[exc.pos - 1 : exc.pos] == b"-" else exc.pos
    return _NON_FINITE_TOKEN.match(bytes(body[start : start + 4])) is not None


def decode_body(body: bytes | bytearray, header_length: str | None) -> InferRequest:
    """A whole request body: JSON, or with ``Inference-Header-Content-Length`` JSON + binary."""
    header, data = split_body(body, header_length)
    return decode_document(parse_json(header), data)


def split_body(
    body: bytes | bytearray, header_length: str | None
) -> tuple[memoryview, memoryview | None]:
    """The JSON of a body and its binary part (None without ``Inference-Header-Content-Length``),
    so the JSON can be measured and checked before the binary part is read."""
    try:
        header, data = binary.split_body(body, header_length)
    except binary.BinaryFormatError as exc:
        raise DecodeError(str(exc)) from exc
    return header, None if header_length is None else data


def decode_document(
    document: Any, data: memoryview | None, regions: shm.Regions | None = None
) -> InferRequest:
    """The request of a parsed JSON document, its binary inputs read from ``data``, those in
    shared memory from ``regions``."""
    try:
        reader = None
        if data is not None:
            # torch refuses read-only memory: a body read into a writable buffer is used as it
            # is, a bytes body copied once; every fixed-size input is then a view of it.
            reader = binary.BinaryReader(data if not data.readonly else memoryview(bytearray(data)))
        request = decode_request(document, reader, regions)
        if reader is not None:
            reader.finish()
    except binary.BinaryFormatError as exc:
        raise DecodeError(str(exc)) from exc
    return request


def declared_inputs(document: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each input's datatype and shape by name, as the document declares them and checked as
    decoding checks them, without reading any data: what the model's check and the estimate of
    the decoded size need before a tensor is built or a byte of the binary part read."""
    declared: dict[str, tuple[str, tuple[int, ...]]] = {}
    for index, raw in enumerate(_raw_inputs(document)):
        name, datatype, shape = _declared_tensor(raw, f"inputs[{index}]")
        if name in declared:
            raise DecodeError(f"input {name!r} appears twice")
        declared[name] = (datatype, shape)
    return declared


def _raw_inputs(document: Any) -> list[Any]:
    if not isinstance(document, dict):
        raise DecodeError("request body must be a JSON object")
    raw_inputs = document.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise DecodeError("field 'inputs' must be a non-empty list of tensors")
    return raw_inputs


def decode_request(
    document: Any,
    reader: binary.BinaryReader | None = None,
    regions: shm.Regions | None = None,
) -> InferRequest:
    """Validate the request document and decode every input tensor, JSON, binary or in shared
    memory."""
    inputs: dict[str, np.ndarray] = {}
    for index, raw in enumerate(_raw_inputs(document)):
        name, array = decode_tensor(raw, f"inputs[{index}]", reader, regions)
        if name in inputs:
            raise DecodeError(f"input {name!r} appears twice")
        inputs[name] = array
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise DecodeError("field 'id' must be a string")
    parameters = _parameters(document.get("parameters"), "parameters")
    return InferRequest(
        request_id, inputs, _requested_outputs(document.get("outputs"), parameters), parameters
    )


def _parameters(raw: Any, where: str) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise DecodeError(f"field '{where}' must be an object")
    return raw


def _requested_outputs(raw: Any, parameters: Mapping[str, Any]) -> tuple[RequestedOutput, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise DecodeError("field 'outputs' must be a list")
    default_binary = bool(parameters.get("binary_data_output", False))
    requested: list[RequestedOutput] = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise DecodeError(f"field 'outputs[{index}].name' must be a string")
        params = _parameters(item.get("parameters"), f"outputs[{index}].parameters")
        classes = params.get(classification.PARAMETER)
        requested.append(
            RequestedOutput(
                item["name"],
                bool(params.get("binary_data", default_binary)),
                0 if classes is None else classification.class_count(classes, item["name"]),
                shm.placement(params, f"output {item['name']!r}"),
            )
        )
    return tuple(requested)


def decode_shape(raw: Any, where: str) -> tuple[int, ...]:
    """A JSON shape, within the limits every front checks (``nograd.protocol.limits``)."""
    if not isinstance(raw, list) or (
        len(raw) <= MAX_DIMS  # a longer one is refused below without reading its items
        and not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw)
    ):
        raise DecodeError(f"field '{where}.shape' must be a list of non-negative integers")
    return checked_shape(raw, where)


def decode_tensor(
    raw: Any,
    where: str,
    reader: binary.BinaryReader | None = None,
    regions: shm.Regions | None = None,
) -> tuple[str, np.ndarray]:
    """One tensor: ``{name, shape, datatype, data}`` with flat or nested row-major data,
    ``{name, shape, datatype, parameters: {binary_data_size}}`` with its bytes in ``reader``, or
    with ``shared_memory_*`` parameters, its bytes in one of ``regions``."""
    name, datatype, shape = _declared_tensor(raw, where)
    where = f"input {name!r}"
    parameters = _parameters(raw.get("parameters"), f"{where}.parameters")
    place = shm.placement(parameters, where)
    if place is not None:
        if "data" in raw or binary.SIZE_PARAMETER in parameters:
            raise DecodeError(f"{where}: has data besides {shm.REGION}; send one")
        return name, shm.read_input(regions, place, name, datatype, shape)
    size = parameters.get(binary.SIZE_PARAMETER)
    if size is not None:
        if "data" in raw:
            raise DecodeError(f"{where}: has both 'data' and {binary.SIZE_PARAMETER}")
        if reader is None:
            raise DecodeError(
                f"{where}: {binary.SIZE_PARAMETER} given but the request has no binary part "
                f"(header {binary.HEADER_LENGTH} missing)"
            )
        return name, reader.take(size, datatype, shape, where)
    if "data" not in raw:
        raise DecodeError(f"{where}: field 'data' is missing")
    return name, decode_data(raw["data"], datatype, shape, where)


def _declared_tensor(raw: Any, where: str) -> tuple[str, str, tuple[int, ...]]:
    """A tensor's name, datatype and shape, checked."""
    if not isinstance(raw, dict):
        raise DecodeError(f"field '{where}' must be an object")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise DecodeError(f"field '{where}.name' must be a non-empty string")
    where = f"input {name!r}"
    shape = decode_shape(raw.get("shape"), where)
    datatype = raw.get("datatype")
    if datatype not in NUMPY_DTYPES:
        raise DecodeError(f"{where}: datatype {datatype!r} is not one of {', '.join(NUMPY_DTYPES)}")
    return name, datatype, shape


def decode_data(data: Any, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    expected = math.prod(shape)
    if datatype == "BYTES":
        flat = _flatten_bytes(data, where)
        array = np.empty(len(flat), dtype=np.object_)
        array[:] = flat
    else:
        array = _numeric(data, datatype, where)
    if array.size != expected:
        raise DecodeError(
            f"{where}: shape {list(shape)} needs {expected} elements, data has {array.size}"
        )
    return array.reshape(shape)


def _numeric(data: Any, datatype: str, where: str) -> np.ndarray:
    target = NUMPY_DTYPES[datatype]
    if not isinstance(data, list):
        data = [data]
    try:
        parsed = np.asarray(data)
    except ValueError as exc:
        raise DecodeError(f"{where}: data is not a regular array: {exc}") from exc
    parsed = parsed.reshape(-1)
    family = "UINT" if datatype.startswith("UINT") else datatype.rstrip("0123456789")
    if parsed.size and parsed.dtype.kind not in _KINDS[family]:
        raise DecodeError(f"{where}: data holds {_kind_name(parsed)} values, not {datatype}")
    if family in ("INT", "UINT") and parsed.size and parsed.dtype.kind in "iu":
        info = np.iinfo(cast(Any, target))
        if parsed.min() < info.min or parsed.max() > info.max:
            raise DecodeError(f"{where}: a value is out of range for {datatype}")
    with np.errstate(over="ignore"):
        converted = parsed.astype(target)
    # All finite is the common case and needs one pass; otherwise an infinity is only an
    # overflow when the value sent was finite.
    checked = family == "FP" and datatype != "FP64" and parsed.size
    if checked and not all_finite(converted) and not all_finite(converted[np.isfinite(parsed)]):
        raise DecodeError(f"{where}: a value is out of range for {datatype}")
    return converted


def _kind_name(array: np.ndarray) -> str:
    return {"U": "string", "O": "mixed or null", "f": "fractional", "b": "boolean"}.get(
        array.dtype.kind, str(array.dtype)
    )


def _flatten_bytes(data: Any, where: str) -> list[bytes]:
    out: list[bytes] = []
    stack: list[Any] = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, str):
            out.append(item.encode("utf-8"))
        else:
            raise DecodeError(f"{where}: BYTES data must be strings, got {type(item).__name__}")
    return out


def select_outputs(
    available: Sequence[str],
    requested: Sequence[RequestedOutput],
    parameters: Mapping[str, Any] | None = None,
) -> list[RequestedOutput]:
    """The outputs to return: all by default (JSON unless the request's ``binary_data_output``
    parameter is true), or the requested subset in the requested order."""
    if not requested:
        default_binary = bool((parameters or {}).get("binary_data_output", False))
        return list(_every_output(tuple(available), default_binary))
    unknown = [r.name for r in requested if r.name not in available]
    if unknown:
        raise DecodeError(
            f"requested output(s) {unknown} not produced; available: {list(available)}"
        )
    return list(requested)


@functools.lru_cache(maxsize=1024)
def _every_output(available: tuple[str, ...], binary: bool) -> tuple[RequestedOutput, ...]:
    """Every output, as a request naming none asks: once per set of names, then shared."""
    return tuple(RequestedOutput(name, binary) for name in available)


def encode_tensor(name: str, array: np.ndarray) -> dict[str, Any]:
    """A JSON output tensor; orjson serialises the numpy data directly without Python lists.

    NaN and +/-Inf become ``null`` (JSON has no such numbers), and the tensor says so with
    ``"parameters": {"non_finite": "null"}``, so a null is never mistaken for a missing value.
    """
    datatype = datatype_of(array)
    flat = array.reshape(-1)
    data: Any
    if datatype == "BYTES":
        data = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat]
    elif datatype == "FP16":
        data = flat.astype(np.float32)
    else:
        data = np.ascontiguousarray(flat)
    tensor: dict[str, Any] = {
        "name": name,
        "datatype": datatype,
        "shape": list(array.shape),
        "data": data,
    }
    if flat.dtype.kind == "f" and not all_finite(flat):
        tensor["parameters"] = {NON_FINITE_PARAMETER: "null"}
    return tensor


class _NonFiniteWarnings:
    """Warns that a model's JSON outputs held NaN or +/-Inf: the first time, then at most once
    per ``NON_FINITE_WARNING_INTERVAL_S``, with the count of such responses in between."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def note(self, model: str | None, outputs: Sequence[str]) -> None:
        key = model or ""
        self._since[key] = self._since.get(key, 0) + 1
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < NON_FINITE_WARNING_INTERVAL_S:
            return
        self._last[key] = now
        count = self._since.pop(key)
        logger.warning(
            "%s: output(s) %s held NaN or +/-Inf, sent as JSON null and marked with "
            'parameters {"%s": "null"} (%d response(s) since the last such warning; binary '
            "outputs carry the values as they are)",
            f"model {model!r}" if model else "a model",
            list(outputs),
            NON_FINITE_PARAMETER,
            count,
            extra={"model": model} if model else None,
        )


_non_finite_warnings = _NonFiniteWarnings()


def encode_outputs(
    outputs: Mapping[str, np.ndarray],
    selected: Sequence[RequestedOutput],
    *,
    model: str | None = None,
    regions: shm.Regions | None = None,
) -> tuple[list[dict[str, Any]], list[bytes | memoryview]]:
    """Output tensors for the response: JSON ones carry ``data``, binary ones a size and bytes,
    those placed in shared memory (written into ``regions``) their placement only.

    ``model`` names the model in the (rate-limited) warning about non-finite JSON outputs.
    """
    tensors: list[dict[str, Any]] = []
    chunks: list[bytes | memoryview] = []
    non_finite: list[str] = []
    for output in selected:
        array = outputs[output.name]
        if output.placement is not None:
            shm.write_output(regions, output.placement, output.name, array)
            tensor: dict[str, Any] = {"name": output.name, "datatype": datatype_of(array)}
            tensor |= {"shape": list(array.shape), "parameters": output.placement.parameters()}
            tensors.append(tensor)
            continue
        if not output.binary:
            tensor = encode_tensor(output.name, array)
            if NON_FINITE_PARAMETER in tensor.get("parameters", ()):
                non_finite.append(output.name)
            tensors.append(tensor)
            continue
        raw = binary.encode_tensor(array)
        tensors.append(
            {
                "name": output.name,
                "datatype": datatype_of(array),
                "shape": list(array.shape),
                "parameters": {binary.SIZE_PARAMETER: len(raw)},
            }
        )
        chunks.append(raw)
    if non_finite:
        _non_finite_warnings.note(model, non_finite)
    return tensors, chunks


def dumps(document: Any) -> bytes:
    return orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
