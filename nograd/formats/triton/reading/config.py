"""Triton model folders read as they are: ``config.pbtxt`` (protobuf text of Triton's
``model_config.proto``), numbered version folders, ``model.onnx`` or ``model.pt``.

Every field of a config.pbtxt is either mapped onto nograd's model config, reported as Triton
reports it (the model configuration endpoints answer with the file's message, completed), logged
as ignored where ignoring it changes no answer, or refused with a load error naming it: a field
nograd cannot honour is never dropped silently.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Final

from google.protobuf import json_format, text_format

from nograd.core.datatypes import TABLE
from nograd.core.engines import engine_choices
from nograd.formats.triton.reading.config_json import config_document
from nograd.formats.triton.reading.ensemble import ensemble_steps
from nograd.formats.triton.reading.generated import model_config_pb2 as pb
from nograd.formats.triton.reading.sequences import queue_delay_ms, sequence_batching
from nograd.schema.config import (
    ConfigError,
    ModelConfig,
    TensorSpec,
    VersionPolicy,
    is_version,
)

logger = logging.getLogger(__name__)

CONFIG_FILE: Final = "config.pbtxt"


class Backend:
    """One Triton backend nograd serves: its platform and backend names, nograd's format for
    its model file, and that file's default name."""

    def __init__(self, platform: str, backend: str, format_: str, filename: str) -> None:
        self.platform = platform
        self.backend = backend
        self.format = format_
        self.filename = filename


ONNX: Final = Backend("onnxruntime_onnx", "onnxruntime", "onnx", "model.onnx")
"""ONNX Runtime's backend: ``model.onnx``, its tensors read from the graph without a config."""
PYTHON: Final = Backend("", "python", "python", "model.py")
"""Triton's Python backend: ``model.py`` defining ``TritonPythonModel``; with no
``config.pbtxt``, its ``auto_complete_config`` gives the tensors and batching when it loads."""
ENSEMBLE: Final = Backend("ensemble", "", "ensemble", "")
"""Triton's ensembles: steps running other models, no file of their own."""
BACKENDS: Final = (
    ONNX,
    Backend("pytorch_libtorch", "pytorch", "torchscript", "model.pt"),
    PYTHON,
    ENSEMBLE,
)
ENGINE_PARAMETER: Final = "nograd_engine"
"""A config parameter (``string_value``) opting a TorchScript model in to nograd's engine choice
(``auto``, or an engine's name); Triton's backends ignore parameters they do not know."""
DATATYPES: Final[dict[str, str]] = {row.triton: row.name for row in TABLE}
"""Triton's ``TYPE_...`` names to the protocol's datatypes (TYPE_STRING is BYTES)."""

IGNORED: Final[dict[str, str]] = {
    "optimization": "nograd chooses its own speed modes and engines (docs/speed.md)",
    "metric_tags": "nograd labels its metrics by model",
    "model_metrics": "nograd's metrics are its own (docs/observability.md)",
    "response_cache": "nograd caches no responses",
    "runtime": "nograd picks the backend's runtime itself",
    "cc_model_filenames": "nograd reads default_model_filename",
    "model_repository_agents": "no repository agent runs; the files are read as they are",
}
"""Fields whose absence of effect changes no answer: read, logged once as ignored."""

MAPPED: Final = frozenset(
    {
        "name",
        "platform",
        "backend",
        "version_policy",
        "max_batch_size",
        "input",
        "output",
        "dynamic_batching",
        "instance_group",
        "default_model_filename",
        "parameters",
        "model_warmup",
        "ensemble_scheduling",
        "sequence_batching",
    }
)
_warned: set[str] = set()
"""Messages already logged: a repository is read again at every poll."""


def is_triton_folder(model_dir: Path) -> bool:
    """A Triton model folder: one with ``config.pbtxt``, or, with no config at all, a numbered
    version folder holding a model file Triton's auto-complete recognises (``model.onnx``,
    ``model.pt``, ``model.py``)."""
    if (model_dir / CONFIG_FILE).is_file():
        return True
    return bool(_versions(model_dir)) and _detect(model_dir) is not None


def read_triton(model_dir: Path) -> ModelConfig:
    """The model in Triton folder ``model_dir`` as nograd's config (its version policy set; the
    version itself is set per numbered folder); a ``ConfigError`` names the file and field."""
    path = model_dir / CONFIG_FILE
    message = pb.ModelConfig()
    if path.is_file():
        try:
            text_format.Parse(path.read_text(encoding="utf-8"), message)
        except (OSError, UnicodeDecodeError, text_format.ParseError) as exc:
            raise ConfigError(f"{path}: cannot parse: {exc}") from exc
    where = str(path) if path.is_file() else f"{model_dir} (no {CONFIG_FILE})"
    try:
        return _convert(model_dir, message, where)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _convert(model_dir: Path, message: Any, where: str) -> ModelConfig:
    folder = model_dir.name
    if message.name and message.name != folder:
        raise ValueError(
            f"field 'name': {message.name!r} differs from the folder's name {folder!r} (Triton "
            "requires them to agree)"
        )
    message.name = folder
    _refuse_unknown(message, where)
    backend = _backend(model_dir, message)
    if message.HasField("ensemble_scheduling") and backend is not ENSEMBLE:
        raise ValueError(
            f"ensemble scheduling cannot be set for model '{folder}' whose platform is not ensemble"
        )
    message.platform, message.backend = backend.platform, backend.backend
    message.default_model_filename = message.default_model_filename or backend.filename
    if not message.HasField("version_policy"):
        message.version_policy.latest.num_versions = 1
    inputs = tuple(_tensor(tensor, "input", where, backend) for tensor in message.input)
    outputs = tuple(
        _tensor(tensor, "output", where, backend, model_dir) for tensor in message.output
    )
    for index, group in enumerate(message.instance_group):
        group.name = group.name or f"{folder}_{index}"
        group.count = group.count or 1
    fields: dict[str, Any] = {
        "name": folder,
        # Triton's metadata names the backend where the config gives no platform.
        "platform": backend.platform or backend.backend,
        "backend": backend.backend,
        "format": backend.format,
        "weights": None,
        "version_policy": _version_policy(message.version_policy),
        "inputs": inputs,
        "outputs": outputs,
    }
    if message.model_transaction_policy.decoupled and backend is not PYTHON:
        raise ValueError(
            "field 'model_transaction_policy': decoupled models are served for the Python "
            "backend only"
        )
    if backend is ENSEMBLE:
        fields["steps"] = ensemble_steps(message)
    elif backend is PYTHON:
        fields["module"] = message.default_model_filename
        fields["decoupled"] = message.model_transaction_policy.decoupled
    else:
        fields["artifact"] = message.default_model_filename
    if message.max_batch_size > 0:
        fields["batch_dimension"] = True
        fields["max_batch_size"] = message.max_batch_size
    elif (inputs and outputs) or backend is not ONNX:
        fields["batch_dimension"] = False
        fields["max_batch_size"] = 1
    else:
        # Triton's auto-complete: read from the ONNX graph when the model loads (as ONNX
        # Runtime's backend reads it, a max_batch_size of 0 is one not given).
        fields["batch_dimension"] = None
    if message.HasField("sequence_batching"):
        fields["sequence"] = sequence_batching(message)
        fields["max_queue_delay_ms"] = queue_delay_ms(message)
    elif message.HasField("dynamic_batching"):
        fields.update(_dynamic_batching(message.dynamic_batching, where))
    else:
        # Without dynamic batching Triton runs each request as it comes; nograd then waits for
        # no other request, batching only those already queued.
        fields["max_queue_delay_ms"] = 0.0
    if message.instance_group:
        fields["device"] = _device(message, where)
    if ENGINE_PARAMETER in message.parameters:
        fields["engine"] = _engine(message.parameters[ENGINE_PARAMETER].string_value, backend)
    unread = sorted(set(message.parameters) - {ENGINE_PARAMETER})
    if unread:
        _warn(
            f"{where}: field 'parameters' ({', '.join(unread)}): reported in the model "
            "configuration; nograd's backends read none of them"
        )
    _complete(message, backend)
    fields["triton_config"] = json.dumps(config_document(message))
    return ModelConfig.model_validate(fields)


def _complete(message: Any, backend: Backend) -> None:
    """What Triton fills in a configuration it loads, so the configuration nograd reports is the
    one Triton reports: pinned-memory optimisation for a model of its own, a transaction policy
    for an ensemble, and, with dynamic batching, a preferred batch size of ``max_batch_size``
    (Triton's ``NormalizeModelConfig``, for every backend)."""
    if backend is ENSEMBLE:
        message.model_transaction_policy.SetInParent()
        return
    if not message.HasField("optimization"):
        message.optimization.input_pinned_memory.enable = True
        message.optimization.output_pinned_memory.enable = True
    batching = message.dynamic_batching
    batched = message.HasField("dynamic_batching") and message.max_batch_size > 0
    if batched and not batching.preferred_batch_size:
        batching.preferred_batch_size.append(message.max_batch_size)


def completed_document(document: dict[str, Any]) -> dict[str, Any]:
    """A Python model's configuration after its ``auto_complete_config`` (which may add
    tensors, a batch size and dynamic batching to the file's, or to none), completed and printed
    as Triton completes and prints the configuration it loads."""
    message = json_format.ParseDict(document, pb.ModelConfig(), ignore_unknown_fields=True)
    _complete(message, PYTHON)
    return config_document(message)


def _refuse_unknown(message: Any, where: str) -> None:
    """Every field set in the file is mapped, ignored with a warning, or refused here."""
    for descriptor, _ in message.ListFields():
        name = descriptor.name
        if name in MAPPED:
            continue
        if name in IGNORED:
            _warn(f"{where}: field {name!r} ignored: {IGNORED[name]}")
            continue
        if name == "model_transaction_policy":
            continue  # decoupled: the Python backend's alone (``_convert``)
        raise ValueError(f"field {name!r} is not supported by nograd")


def _backend(model_dir: Path, message: Any) -> Backend:
    platform, backend = message.platform, message.backend
    if not platform and not backend:
        found = _detect(model_dir, message.default_model_filename)
        if found is None:
            raise ValueError(
                "field 'platform': none given and no model file nograd recognises "
                f"({', '.join(b.filename for b in BACKENDS)}) in a version folder"
            )
        return found
    for candidate in BACKENDS:
        if platform in ("", candidate.platform) and backend in ("", candidate.backend):
            return candidate
    name = "backend" if backend else "platform"
    served = ", ".join(f"{b.platform} / {b.backend}" if b.platform else b.backend for b in BACKENDS)
    raise ValueError(
        f"field {name!r}: {backend or platform!r} is not served by nograd (it serves {served})"
    )


MAX_LABELS_BYTES: Final = 64 * 1024 * 1024
"""Largest labels file an output may name."""


def _detect(model_dir: Path, filename: str = "") -> Backend | None:
    for version in _versions(model_dir):
        for backend in BACKENDS:
            if backend is ENSEMBLE:
                continue
            if (model_dir / version / (filename or backend.filename)).exists() and (
                not filename or filename.endswith(Path(backend.filename).suffix)
            ):
                return backend
    return None


def _versions(model_dir: Path) -> list[str]:
    return [d.name for d in model_dir.iterdir() if d.is_dir() and is_version(d.name)]


def _tensor(
    tensor: Any, kind: str, where: str, backend: Backend, model_dir: Path | None = None
) -> TensorSpec:
    label = f"field '{kind}' {tensor.name!r}"
    for unsupported in ("is_shape_tensor", "allow_ragged_batch", "is_non_linear_format_io"):
        if unsupported in tensor.DESCRIPTOR.fields_by_name and getattr(tensor, unsupported):
            raise ValueError(f"{label}: {unsupported!r} is not supported by nograd")
    if kind == "input" and tensor.optional and backend is not PYTHON:
        raise ValueError(
            f"{label}: 'optional' inputs are served by nograd's python backend only: its "
            f"{backend.backend or backend.platform} backend runs each batch as one call that "
            "takes every input"
        )
    if kind == "input" and tensor.format != pb.ModelInput.FORMAT_NONE:
        _warn(f"{where}: {label}: 'format' is reported only; nograd passes tensors as sent")
    labels: tuple[str, ...] = ()
    if kind == "output" and tensor.label_filename and model_dir is not None:
        labels = _labels(model_dir, tensor.label_filename, label)
    type_name = pb.DataType.Name(tensor.data_type)
    datatype = DATATYPES.get(type_name)
    if datatype is None:
        raise ValueError(f"{label}: 'data_type' {type_name} is not served by nograd")
    if datatype == "BYTES" and backend.format == "torchscript":
        raise ValueError(
            f"{label}: 'data_type' TYPE_STRING is not served by nograd's {backend.backend} "
            "backend (TorchScript tensors pass through torch, which holds no strings; the "
            "onnxruntime and python backends take them)"
        )
    dims = tuple(int(d) for d in tensor.dims)
    reshape = tuple(int(d) for d in tensor.reshape.shape) if tensor.HasField("reshape") else None
    if dims == (1,) and reshape == ():
        # Triton's scalar sample; nograd's own convention for a shape of [].
        dims, reshape = (), None
    optional = kind == "input" and tensor.optional
    return TensorSpec(
        name=tensor.name,
        datatype=datatype,
        shape=dims,
        reshape=reshape,
        optional=optional,
        labels=labels,
    )


def _labels(model_dir: Path, filename: str, label: str) -> tuple[str, ...]:
    """An output's ``label_filename``: one class name per line, the line's number its index (as
    Triton reads it); a file in the model's folder, of at most ``MAX_LABELS_BYTES``."""
    path = model_dir / filename
    if Path(filename).is_absolute() or ".." in Path(filename).parts or not path.is_file():
        raise ValueError(
            f"{label}: 'label_filename' {filename!r} is not a file in the model folder"
        )
    if path.stat().st_size > MAX_LABELS_BYTES:
        raise ValueError(f"{label}: 'label_filename' {filename!r} is over {MAX_LABELS_BYTES} bytes")
    return tuple(path.read_text(encoding="utf-8", errors="replace").splitlines())


def _engine(value: str, backend: Backend) -> str:
    """The ``nograd_engine`` parameter: a TorchScript model's opt-in to nograd's engine choice."""
    label = f"field 'parameters' key {ENGINE_PARAMETER!r}"
    if backend.format != "torchscript":
        raise ValueError(
            f"{label}: only a TorchScript model (platform pytorch_libtorch) may choose another "
            f"engine; this {backend.backend} model runs on its own backend's runtime"
        )
    if value not in engine_choices():
        raise ValueError(f"{label}: {value!r} is not one of {', '.join(engine_choices())}")
    return value


def _version_policy(policy: Any) -> VersionPolicy:
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return VersionPolicy(all=True)
    if choice == "specific":
        versions = tuple(str(v) for v in policy.specific.versions)
        return VersionPolicy(specific=versions)
    return VersionPolicy(latest=max(1, policy.latest.num_versions))


def _dynamic_batching(batching: Any, where: str) -> dict[str, Any]:
    fields: dict[str, Any] = {"max_queue_delay_ms": batching.max_queue_delay_microseconds / 1000}
    if batching.preferred_batch_size:
        _warn(
            f"{where}: field 'dynamic_batching.preferred_batch_size' reported only: nograd's "
            "batcher takes whatever is queued, up to the memory-planned limit"
        )
    if batching.priority_levels or batching.priority_queue_policy:
        _warn(f"{where}: field 'dynamic_batching' priorities ignored: one queue per model")
    policy = batching.default_queue_policy
    if policy.max_queue_size:
        fields["max_queue_size"] = policy.max_queue_size
    if policy.default_timeout_microseconds:
        _warn(
            f"{where}: field 'dynamic_batching.default_queue_policy.default_timeout_microseconds'"
            " ignored: NOGRAD_REQUEST_TIMEOUT_S bounds every request"
        )
    return fields


def _device(message: Any, where: str) -> str:
    """nograd runs one instance per model and worker, on one device: the first group's kind
    (and first GPU) chooses it; the rest is reported."""
    groups = list(message.instance_group)
    first = groups[0]
    described = ", ".join(
        f"{pb.ModelInstanceGroup.Kind.Name(g.kind)} x{g.count or 1}"
        + (f" gpus {list(g.gpus)}" if g.gpus else "")
        for g in groups
    )
    device = "auto"
    if first.kind == pb.ModelInstanceGroup.KIND_GPU:
        device = f"cuda:{first.gpus[0]}" if first.gpus else "cuda"
    elif first.kind == pb.ModelInstanceGroup.KIND_CPU:
        device = "cpu"
    _warn(
        f"{where}: instance_group [{described}]: nograd runs one instance on {device} per worker "
        "(NOGRAD_WORKERS for more), batching requests instead of running them side by side"
    )
    return device


def _warn(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        logger.warning("%s", text)
