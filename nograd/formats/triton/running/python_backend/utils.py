"""nograd's ``triton_python_backend_utils``: the module a Triton Python model imports, with the
names and behaviour of Triton's own (requests, tensors, responses, errors, config look-ups,
datatype conversions, the auto-complete ``ModelConfig``).

Model-facing code, like nograd's SDK: registered in ``sys.modules`` under Triton's name before a
Python-backend model is imported. Tensors are numpy arrays on the host; BYTES (``TYPE_STRING``)
tensors are object arrays of ``bytes``, as Triton hands them to a model.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import numpy as np

TRITON_STRING_TO_NUMPY: Final[dict[str, Any]] = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
_TYPE_CODES: Final[tuple[Any, ...]] = (
    None,
    np.bool_,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
    np.object_,
)
"""Triton's ``DataType`` enum values (``TYPE_BOOL`` is 1, ``TYPE_STRING`` 13) as numpy types."""

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START: Final = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END: Final = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL: Final = 1
TRITONSERVER_REQUEST_RELEASE_ALL: Final = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: Final = 2


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> Any:
    return _TYPE_CODES[data_type] if 0 < data_type < len(_TYPE_CODES) else None


def numpy_to_triton_type(data_type: Any) -> int | None:
    if data_type == np.bytes_:
        return 13
    for code, numpy_type in enumerate(_TYPE_CODES):
        if numpy_type is not None and data_type == numpy_type:
            return code
    return None


def serialize_byte_tensor(input_tensor: np.ndarray) -> Any:
    """Each element as a 4-byte little-endian length and its bytes, in C order (str elements
    UTF-8 encoded); ``()`` for an empty tensor, None for a tensor that holds no bytes."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    chunks: list[bytes] = []
    for item in input_tensor.reshape(-1, order="C"):
        data = item if isinstance(item, bytes) else str(item).encode("utf-8")
        chunks.append(struct.pack("<I", len(data)))
        chunks.append(data)
    return b"".join(chunks)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    """The elements of ``serialize_byte_tensor``'s encoding as a 1-D object array of bytes."""
    items: list[bytes] = []
    offset = 0
    while offset < len(encoded_tensor):
        (length,) = struct.unpack_from("<I", encoded_tensor, offset)
        offset += 4
        items.append(bytes(encoded_tensor[offset : offset + length]))
        offset += length
    array = np.empty(len(items), dtype=np.object_)
    array[:] = items
    return array


class TritonError:
    """An error a model answers one request with (``InferenceResponse(error=...)``); its code
    chooses the status (``INTERNAL``, the default, is a 500; ``INVALID_ARG`` a 400)."""

    UNKNOWN: Final = 0
    INTERNAL: Final = 1
    NOT_FOUND: Final = 2
    INVALID_ARG: Final = 3
    UNAVAILABLE: Final = 4
    UNSUPPORTED: Final = 5
    ALREADY_EXISTS: Final = 6
    CANCELLED: Final = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        if message is None:
            raise TypeError("TritonError: message must not be None")
        self._message = str(message)
        self._code = int(code)

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code})"


class TritonModelException(Exception):
    """Raised by the backend's own calls; a model may raise it from ``execute`` too."""


class Tensor:
    """A named tensor on the host."""

    def __init__(self, name: str, data: Any) -> None:
        if not isinstance(data, np.ndarray):
            raise TritonModelException(
                f"tensor {name!r}: Tensor takes a numpy array, got {type(data).__name__}"
            )
        if data.dtype.type == np.str_ or data.dtype.type == np.bytes_:
            data = data.astype(np.object_)
        self._name = name
        self._data: np.ndarray = data

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._data

    def shape(self) -> list[int]:
        return list(self._data.shape)

    def triton_dtype(self) -> int | None:
        return numpy_to_triton_type(self._data.dtype.type)

    def is_cpu(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={list(self._data.shape)}, dtype={self._data.dtype})"


class InferenceRequest:
    """One request as the model's ``execute`` receives it."""

    def __init__(
        self,
        inputs: Sequence[Tensor],
        requested_output_names: Sequence[str] = (),
        request_id: str = "",
        model_name: str = "",
        model_version: int = -1,
        parameters: str = "{}",
        sender: InferenceResponseSender | None = None,
        correlation_id: int | str = 0,
        flags: int = 0,
    ) -> None:
        self._sender = sender
        self._correlation_id = correlation_id
        self._flags = flags
        self._inputs = list(inputs)
        self._requested = list(requested_output_names)
        self._id = request_id
        self._model_name = model_name
        self._model_version = model_version
        self._parameters = parameters

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._requested

    def request_id(self) -> str:
        return self._id

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def parameters(self) -> str:
        return self._parameters

    def flags(self) -> int:
        """The sequence flags: ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START`` (1) and ``_END`` (2)."""
        return self._flags

    def correlation_id(self) -> int | str:
        """The sequence's id (a number or a string); 0 outside a sequence."""
        return self._correlation_id

    def is_cancelled(self) -> bool:
        return False

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException(
                "a response sender is a decoupled model's (model_transaction_policy "
                "{ decoupled: true }); this model's execute returns one InferenceResponse per "
                "request"
            )
        return self._sender

    def exec(self, *args: Any, **kwargs: Any) -> Any:
        raise TritonModelException(
            "business logic scripting (InferenceRequest.exec) is not served by nograd"
        )

    async_exec = exec


class InferenceResponseSender:
    """A decoupled model's way to answer one request: any number of responses, from any
    thread, the last one (or none) flagged ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``."""

    def __init__(self, send: Callable[[InferenceResponse | None, bool], None]) -> None:
        self._send = send
        self._closed = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException("a response without the final flag must hold a response")
        if final:
            self._closed = True
        self._send(response, final)

    def is_cancelled(self) -> bool:
        return False


class InferenceResponse:
    """One request's answer: its output tensors, or an error."""

    def __init__(
        self,
        output_tensors: Iterable[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: Any = None,
    ) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    return _named(inference_request.inputs(), name)


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    return _named(inference_response.output_tensors(), name)


def _named(tensors: Iterable[Tensor], name: str) -> Tensor | None:
    return next((tensor for tensor in tensors if tensor.name() == name), None)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return _config_named(model_config.get("input", ()), name)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return _config_named(model_config.get("output", ()), name)


def _config_named(tensors: Iterable[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((tensor for tensor in tensors if tensor.get("name") == name), None)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class ModelConfig:
    """The configuration ``auto_complete_config`` receives and returns: only the batch size,
    dynamic batching, inputs and outputs may change, as in Triton."""

    def __init__(self, model_config: str) -> None:
        self._model_config: dict[str, Any] = json.loads(model_config)
        self._model_config.setdefault("input", [])
        self._model_config.setdefault("output", [])
        self._model_config.setdefault("max_batch_size", 0)

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        given = int(self._model_config.get("max_batch_size", 0))
        if given > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {given}, but in auto-complete-config "
                f"function for model '{self._name()}' specified max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for scheduler in ("sequence_batching", "ensemble_scheduling"):
            if scheduler in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{scheduler}', but "
                    f"auto-complete-config function for model '{self._name()}' tries to set "
                    "scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict[str, Any]) -> None:
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output, ("name", "data_type", "dims"))

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        self._model_config["model_transaction_policy"] = dict(transaction_policy_dict)

    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def _add(self, kind: str, tensor: dict[str, Any], allowed: tuple[str, ...]) -> None:
        model = self._name()
        extra = sorted(set(tensor) - set(allowed))
        if extra:
            raise ValueError(
                f"{kind} '{tensor.get('name')}' in auto-complete-config function for model "
                f"'{model}' contains property other than {', '.join(map(repr, allowed))}."
            )
        for field in ("name", "data_type", "dims"):
            if field not in tensor:
                raise ValueError(
                    f"{kind} in auto-complete-config function for model '{model}' is missing "
                    f"'{field}' property."
                )
        for current in self._model_config[kind]:
            if current.get("name") != tensor["name"]:
                continue
            given_type = current.get("data_type", "TYPE_INVALID")
            if given_type != "TYPE_INVALID" and given_type != tensor["data_type"]:
                raise ValueError(
                    f"unable to load model '{model}', configuration expects datatype "
                    f"{given_type} for {kind} '{tensor['name']}', model provides "
                    f"{tensor['data_type']}"
                )
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise ValueError(
                    f"model '{model}', tensor '{tensor['name']}': the model expects dims "
                    f"{list(tensor['dims'])} but the model configuration specifies dims "
                    f"{list(current['dims'])}"
                )
            current.update(tensor)
            return
        self._model_config[kind].append(dict(tensor))
