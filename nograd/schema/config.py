"""Model configuration files (``models/<name>/config.toml`` or ``config.yaml``).

A malformed config must fail loudly at startup with the file and the field named, because a model
that silently loads with a wrong shape or batch size is worse than one that does not load.
"""

from __future__ import annotations

import itertools
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nograd.core.engines import (
    AUTO,
    EAGER,
    artifact_engines,
    auto_defaults,
    built_engines,
    engine_choices,
    engine_row,
    int8_variant,
    signature_formats,
)
from nograd.schema.ensemble_step import EnsembleStep as EnsembleStep
from nograd.schema.sequence_config import SequenceBatching
from nograd.schema.tensor_spec import TensorSpec as TensorSpec
from nograd.schema.versions import VersionPolicy as VersionPolicy
from nograd.schema.versions import check_model_name as check_model_name
from nograd.schema.versions import check_version as check_version
from nograd.schema.versions import is_version as is_version
from nograd.schema.versions import version_order as version_order

Precision = Literal["fp32", "bf16", "fp16", "int8"]
PYTHON_FORMAT = "python"
"""A model folder of Python code (``module``); every other format is an engine's artifact, named
as in the engine table (``nograd.core.engines``)."""
TORCHSERVE_FORMAT = "torchserve"
"""A TorchServe model archive (``.mar``), unpacked by ``nograd.formats.torchserve.reading``:
its handler runs as TorchServe runs it (``nograd.formats.torchserve.running``)."""
ENSEMBLE_FORMAT = "ensemble"
"""A Triton ensemble: no model of its own; ``steps`` run other served models
(``nograd.serving.ensembles``)."""
CompileMode = Literal["default", "reduce-overhead", "max-autotune"]
CONFIG_NAMES = ("config.toml", "config.yaml", "config.yml")
_DEVICE_RE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")


class ConfigError(Exception):
    """A model config that cannot be used; the message names the file and the field."""


class ModelConfig(BaseModel):
    """What nograd needs to serve one model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    version: str = "1"
    """The version a model folder without numbered version folders serves; with them, each
    folder's name is its version."""
    version_policy: VersionPolicy = VersionPolicy()
    platform: str = "pytorch"
    backend: str = "nograd"
    """The backend the model configuration reports: nograd for its own folders, Triton's
    (``onnxruntime``, ``pytorch``) for a Triton model folder."""
    batch_dimension: bool | None = True
    """True: every input and output has a batch dimension first, not listed in ``shape``, and
    requests are batched. False (Triton's ``max_batch_size: 0``): requests carry exactly the
    listed shapes and each runs alone. None: read from an ONNX artifact at load, as Triton's
    auto-complete does (batched when every tensor's first dimension is variable)."""
    decoupled: bool = False
    """A Triton Python model that answers a request with 0..n responses through its response
    sender (``model_transaction_policy { decoupled: true }``): served over ``ModelStreamInfer``."""
    triton_config: str | None = None
    """A Triton model folder's configuration (``config.pbtxt`` as JSON, completed): what the
    model configuration endpoints report for it. Set by the repository reader; None for nograd's
    own folders."""
    module: str = "model.py"
    """Python file, inside the model folder, that builds the model."""
    weights: str | None = "model.safetensors"
    """Weights file inside the model folder: .safetensors, or .pt/.pth read with weights_only.
    Empty (``weights = ""``; TOML has no null) when the model's ``build_handler`` loads its own."""
    inputs: tuple[TensorSpec, ...] = ()
    """Required, except for a torch_export or onnx artifact, whose signature names them."""
    outputs: tuple[TensorSpec, ...] = ()
    steps: tuple[EnsembleStep, ...] = ()
    """An ensemble's steps (format ``ensemble``), in the config's order."""
    sequence: SequenceBatching | None = None
    """A sequence model (Triton's ``sequence_batching``): its requests name a sequence, and
    the server feeds it control inputs and keeps its implicit state per sequence."""
    max_batch_size: int | None = Field(default=None, ge=1, le=65536)
    max_queue_delay_ms: float | None = Field(default=None, ge=0.0, le=10_000.0)
    max_queue_size: int | None = Field(default=None, ge=1)
    resident: Literal["on_demand", "always"] = "on_demand"
    """Under ``NOGRAD_MODEL_CONTROL=on_demand``: ``always`` loads the model at start-up and
    never evicts it; ``on_demand`` loads it on its first request and may evict it."""
    device: str = "auto"
    precision: Precision = "fp32"
    batch_unit: Literal["samples", "tokens"] = "samples"
    """Unit of the batch limit: samples, or padded tokens for sequence models."""
    max_batch_tokens: int | None = Field(default=None, ge=1)
    """Cap on padded tokens per batch for token-unit models."""
    reject_non_finite: bool = True
    """Refuse (400, naming the input) a request whose floating-point input holds NaN or +/-Inf:
    a model rarely means anything by them, and its outputs would only come back as nulls.
    False passes them to the model unchanged. Inputs of other datatypes are never checked."""

    # Engines (nograd/runtime/engines/; docs/speed.md).
    format: str = PYTHON_FORMAT
    """``python``: ``module`` builds a torch model. An engine's name (``torch_export``: a ``.pt2``
    from ``torch.export.save``; ``aoti``: an AOTInductor package; ``onnx``): ``artifact`` is the
    model, served by its own engine; ``module``, if its file exists, supplies only the handler
    (pre- and post-processing around the artifact)."""
    artifact: str | None = None
    """The artifact file inside the model folder, for formats other than python."""
    artifact_sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")
    """When set, the artifact's SHA-256; checked before the artifact is loaded."""
    engine: str | None = None
    """What runs a python model: ``eager`` (default), an engine built from it at load
    (``torch_export``, ``aoti``, ``onnx``; cached, checked against eager like a speed mode), or
    ``auto``: every engine in ``engines`` built, checked and timed, the fastest accepted one
    serving (per batch-size range). Other formats run on their own engine only."""
    engines: tuple[str, ...] = auto_defaults()
    """The engines ``auto`` considers; aoti is not among the default ones because compiling
    costs minutes of start-up (docs/speed.md)."""
    min_match_rate: float | None = Field(default=None, ge=0.0, le=1.0)
    """Integer and boolean outputs (a classifier's labels): the smallest fraction of elements
    an engine or speed mode must give exactly as fp32 eager does. Unset: not checked."""

    # Speed modes (nograd/runtime/speed/; docs/speed.md). Each one is checked against fp32 eager
    # before it serves, and refused (fp32 eager serves instead) when its outputs drift too far or
    # it runs slower.
    autocast: bool = False
    """With ``precision`` bf16/fp16: run the forward under ``torch.autocast`` (fp32 weights, low
    precision matmuls) instead of casting the weights and float inputs."""
    channels_last: bool = False
    """Convolution models: weights and 4-D float inputs in channels-last (NHWC) memory order,
    the layout oneDNN's CPU convolutions (and GPU tensor cores) run fastest on. A model that
    reshapes feature maps with ``.view`` fails in this layout and is refused (fp32 eager serves)."""
    compile: bool = False
    """``torch.compile`` the model during warmup (every bucket, or dynamic shapes, once)."""
    compile_mode: CompileMode = "default"
    """torch.compile mode: default, reduce-overhead (CUDA graphs inside inductor), max-autotune."""
    compile_buckets: tuple[int, ...] | None = None
    """Batch sizes (rows) to pad every batch to, ascending: fixed shapes, compiled (and captured)
    once each, so traffic never triggers a recompile; batches above the largest run in chunks.
    Unset with ``compile``: dynamic shapes (``dynamic=True``), no padding."""
    compile_length_buckets: tuple[int, ...] | None = None
    """Token models: sequence lengths to pad to, ascending; required with ``compile_buckets``."""
    cuda_graphs: bool = False
    """Capture one CUDA graph per bucket after warmup and replay it (CUDA only; needs
    ``compile_buckets``; ignored with a warning on CPU)."""
    accuracy_tolerance: float | None = Field(default=None, gt=0.0)
    """Largest max-abs error of any float output vs fp32 eager; unset: 1e-2 when precision is
    bf16/fp16, 1e-4 for fp32 with channels-last, compile or CUDA graphs."""
    min_cosine: float = Field(default=0.999, ge=-1.0, le=1.0)
    """Smallest per-sample cosine similarity of any float output vs fp32 eager."""
    min_speedup: float = Field(default=0.9, ge=0.0)
    """The mode must run the warmup batches at least this many times as fast as fp32 eager on
    this machine, timed at load, or it is refused: bf16, fast on a CPU with native bf16, can be
    several times slower on one without (docs/speed.md). The default leaves room for timing
    noise (a mode as fast as fp32 eager serves); 0 turns the check off, for a mode wanted for its
    memory, not its speed."""
    accuracy_sample: str | None = None
    """A V2 inference request body (JSON) inside the model folder, e.g. ``sample.json``: real
    inputs the accuracy check compares on too, as synthetic ones may miss the model's real range."""

    @property
    def from_code(self) -> bool:
        """Its ``module`` builds the torch model (format ``python``); every other format brings
        an engine's artifact, an archive's handler or an ensemble's steps."""
        return self.format == PYTHON_FORMAT

    @property
    def runs_steps(self) -> bool:
        """An ensemble: no model of its own, its ``steps`` run other served models."""
        return self.format == ENSEMBLE_FORMAT

    @property
    def runs_own_handler(self) -> bool:
        """An archive whose handler runs as its own server runs it: no artifact, no engine."""
        return self.format == TORCHSERVE_FORMAT

    @property
    def names_tensors_at_load(self) -> bool:
        """Whether its inputs and outputs may be left out of its config, named when it loads:
        an artifact whose engine reads its signature, or code that completes a configuration
        document of its own (``triton_config``: a Triton Python model's
        ``auto_complete_config``)."""
        if self.from_code:
            return self.triton_config is not None
        return self.format in signature_formats()

    @property
    def takes_engine(self) -> bool:
        """Whether its forward may run on an engine chosen for it (``engine``,
        ``NOGRAD_ENGINE``): a python model's, or an artifact's that loads as an eager torch
        module (TorchScript, Triton's PyTorch backend; the engine table's ``eager_forward``)."""
        if self.from_code:
            return True
        return self.format in artifact_engines() and engine_row(self.format).eager_forward

    @field_validator("name")
    @classmethod
    def _name_valid(cls, name: str) -> str:
        return check_model_name(name)

    @field_validator("version", mode="before")
    @classmethod
    def _version_text(cls, value: object) -> object:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("version")
    @classmethod
    def _version_valid(cls, version: str) -> str:
        return check_version(version)

    @field_validator("device")
    @classmethod
    def _device_valid(cls, device: str) -> str:
        if not _DEVICE_RE.match(device):
            raise ValueError(f"device {device!r} must be cpu, cuda, cuda:N or auto")
        return device

    @field_validator("format")
    @classmethod
    def _format_known(cls, value: str) -> str:
        formats = (PYTHON_FORMAT, TORCHSERVE_FORMAT, ENSEMBLE_FORMAT, *artifact_engines())
        return _one_of(value, formats)

    @field_validator("engine")
    @classmethod
    def _engine_known(cls, value: str | None) -> str | None:
        return None if value is None else _one_of(value, engine_choices())

    @field_validator("engines")
    @classmethod
    def _engines_known(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            _one_of(name, (EAGER, *built_engines()))
        return value

    @field_validator("weights", mode="before")
    @classmethod
    def _empty_weights_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("module", "weights", "accuracy_sample", "artifact")
    @classmethod
    def _inside_folder(cls, value: str | None) -> str | None:
        if value is not None and (Path(value).is_absolute() or ".." in Path(value).parts):
            raise ValueError(f"path {value!r} must be relative and stay inside the model folder")
        return value

    @field_validator("compile_buckets", "compile_length_buckets")
    @classmethod
    def _buckets_ascending(cls, buckets: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if buckets is None:
            return None
        if not buckets:
            raise ValueError("must list at least one size (or be left out)")
        if any(size < 1 for size in buckets):
            raise ValueError(f"sizes must be positive, got {list(buckets)}")
        if any(a >= b for a, b in itertools.pairwise(buckets)):
            raise ValueError(f"sizes must be strictly ascending, got {list(buckets)}")
        return buckets

    @model_validator(mode="after")
    def _names_unique(self) -> ModelConfig:
        for kind, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            names = [spec.name for spec in specs]
            if len(names) != len(set(names)):
                raise ValueError(f"{kind} names must be unique, got {names}")
        return self

    @model_validator(mode="after")
    def _engine_consistent(self) -> ModelConfig:
        check_engine_fields(self)
        return self

    @model_validator(mode="after")
    def _optional_inputs_served(self) -> ModelConfig:
        optional = [spec.name for spec in self.inputs if spec.optional]
        if optional and not self.from_code:
            raise ValueError(
                f"input(s) {optional}: 'optional' inputs are served for Python-backend models "
                f"only, not format {self.format!r}: its batches run as one forward that takes "
                "every input"
            )
        return self

    @model_validator(mode="after")
    def _speed_options_consistent(self) -> ModelConfig:
        # Each message names the field to change, as every config error does.
        if self.autocast and self.precision == "fp32":
            raise ValueError("field 'autocast': needs precision bf16 or fp16, got fp32")
        fixed = self.compile_buckets is not None or self.compile_length_buckets is not None
        if fixed and not (self.compile or self.cuda_graphs):
            raise ValueError(
                "field 'compile_buckets': fixed shapes only apply with compile = true or "
                "cuda_graphs = true"
            )
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"field 'compile_mode': {self.compile_mode!r} needs compile = true")
        tokens = self.batch_unit == "tokens"
        if self.compile_length_buckets is not None and not tokens:
            raise ValueError(
                "field 'compile_length_buckets': only for batch_unit = \"tokens\" models"
            )
        if (
            tokens
            and fixed
            and (self.compile_buckets is None or self.compile_length_buckets is None)
        ):
            raise ValueError(
                "field 'compile_buckets': a token model with fixed shapes needs both "
                "compile_buckets and compile_length_buckets"
            )
        if self.cuda_graphs and self.compile_buckets is None:
            raise ValueError("field 'cuda_graphs': needs compile_buckets (fixed batch shapes)")
        if self.cuda_graphs and self.compile_mode == "reduce-overhead":
            raise ValueError(
                "field 'cuda_graphs': compile_mode 'reduce-overhead' already captures CUDA "
                "graphs; use one or the other"
            )
        largest = self.compile_buckets[-1] if self.compile_buckets else None
        if (
            largest is not None
            and self.max_batch_size is not None
            and (largest > self.max_batch_size)
        ):
            raise ValueError(
                f"field 'compile_buckets': largest bucket {largest} exceeds max_batch_size "
                f"{self.max_batch_size}"
            )
        return self


def chooses_engine(config: ModelConfig) -> bool:
    """Whether the model's forward may run on an engine built from it at load: a python model,
    or an eager-forward artifact (TorchScript) opted in (``engine`` other than eager or its
    own), whose module is then the eager forward the engines are checked against."""
    if config.from_code:
        return True
    return config.takes_engine and config.engine not in (None, EAGER, config.format)


def check_engine_fields(config: ModelConfig) -> None:
    """The format, artifact, engine and precision fields agree; each error names the field."""
    python = config.from_code
    if config.runs_steps != bool(config.steps):
        raise ValueError("field 'steps': an ensemble lists its steps, and only an ensemble does")
    if config.runs_steps:
        if config.artifact is not None or config.engine is not None:
            raise ValueError("field 'format': an ensemble runs other models, no file of its own")
        return
    if config.runs_own_handler:
        if config.artifact is not None or config.engine is not None:
            raise ValueError("field 'format': a TorchServe archive runs its own handler")
        return
    if not python and config.artifact is None:
        raise ValueError(f"field 'artifact': format {config.format!r} needs the artifact's file")
    if python and config.artifact is not None:
        raise ValueError("field 'artifact': only for a format other than \"python\"")
    if not python and not chooses_engine(config) and config.engine not in (None, config.format):
        raise ValueError(
            f"field 'engine': a {config.format} artifact runs on its own engine, "
            f"got {config.engine!r}"
        )
    for kind, specs in (("inputs", config.inputs), ("outputs", config.outputs)):
        if not specs and not config.names_tensors_at_load:
            raise ValueError(
                f"field '{kind}': required (only {' and '.join(signature_formats())} artifacts "
                "name their own)"
            )
    if not config.engines or len(set(config.engines)) != len(config.engines):
        raise ValueError(f"field 'engines': list distinct engines, got {list(config.engines)}")
    if config.precision == "int8":
        if config.engine != AUTO and int8_variant(config.engine or EAGER) is None:
            quantising = [name for name in artifact_engines() if int8_variant(name) is not None]
            raise ValueError(
                "field 'precision': int8 is an engine's quantised variant, built from a python "
                f"model; set engine to {' or '.join(repr(n) for n in [*quantising, AUTO])} (an "
                "artifact is quantised by nograd export)"
            )
        if config.autocast or config.compile or config.cuda_graphs:
            raise ValueError(
                "field 'precision': int8 is an engine's precision; autocast, compile and "
                "cuda_graphs apply to bf16/fp16 on torch eager"
            )


def _one_of(value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
    return value


def find_config(model_dir: Path) -> Path | None:
    """The config file of a model folder, or None when the folder holds no model."""
    for name in CONFIG_NAMES:
        candidate = model_dir / name
        if candidate.is_file():
            return candidate
    return None


def load_config(
    path: Path,
    *,
    override: Mapping[str, object] | None = None,
    version: str | None = None,
    name: str | None = None,
) -> ModelConfig:
    """Parse and validate one config file; every error names ``path`` and the field.

    ``override``: fields that replace the file's (a load call's config); ``version``: the
    numbered folder the config serves; ``name``: the model's, when the file names none (the
    folder's name otherwise)."""
    try:
        text = path.read_text(encoding="utf-8")
        raw = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot parse: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a table of settings at the top level")
    raw.setdefault("name", name or path.parent.name)
    if override:
        raw.update(override)
    if version is not None:
        raw["version"] = version
    try:
        return ModelConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc']) or '<root>'}': {err['msg']}"
            + (f" (got {err['input']!r})" if err["type"] != "missing" else "")
            for err in exc.errors()
        )
        raise ConfigError(f"{path}: {problems}") from exc
