"""Triton's ``model_warmup`` run when a Triton model loads: each sample's requests through the
model as Triton builds them (``zero_data``, ``random_data``, or the raw bytes of a file under the
model's ``warmup/`` folder), ``batch_size`` requests of one sample each in one batch, ``count``
times; a sample that fails fails the load with Triton's message.

The Python backend's samples reach ``execute`` as any batch does, so a model can prepare itself
on them as it would under Triton.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from nograd.core.datatypes import TABLE
from nograd.formats.triton.running.python_backend.utils import deserialize_bytes_tensor
from nograd.runtime.handler import TensorPart
from nograd.runtime.runners import Handler, batch_runner
from nograd.schema.config import ModelConfig

logger = logging.getLogger(__name__)

WARMUP_FOLDER: Final = "warmup"
"""Where a sample's ``input_data_file`` is read, in the model's folder (Triton's)."""
_TYPES: Final = {row.triton: row for row in TABLE}


class WarmupFailed(Exception):
    """A warmup sample that could not be built or run: the model does not load."""


@dataclass(frozen=True)
class WarmupSample:
    """One ``model_warmup`` entry: its requests (one sample each) and how many times to run."""

    name: str
    parts: tuple[TensorPart, ...]
    count: int


def warmup_samples(config: ModelConfig, model_folder: Path) -> list[WarmupSample]:
    """The config's ``model_warmup`` samples, built as Triton builds them; a sample of
    ``batch_size`` 0 is skipped, as in Triton."""
    if config.triton_config is None:
        return []
    document: dict[str, Any] = json.loads(config.triton_config)
    samples = []
    for setting in document.get("model_warmup", []):
        name = str(setting.get("name", ""))
        batch_size = int(setting.get("batch_size", 0))
        if batch_size == 0:
            logger.info("model %s: skipping batch 0 warmup sample '%s'", config.name, name)
            continue
        most = config.max_batch_size if config.batch_dimension else 1
        if batch_size > (most or 1):
            raise WarmupFailed(
                f"warmup sample '{name}': batch_size {batch_size} is more than model "
                f"'{config.name}' takes in one batch ({most or 1}, its max_batch_size)"
            )
        tensors = _inputs(config, name, setting.get("inputs", {}), model_folder)
        part = TensorPart(tensors, 1)
        samples.append(
            WarmupSample(name, (part,) * batch_size, max(1, int(setting.get("count", 0))))
        )
    return samples


def warm_up_model(handler: Handler, model_dir: Path) -> None:
    """Triton's format's warm-up (``Format.warmup``): the samples of the model's config, their
    files read from the model's folder (above its numbered version folder), run on ``handler``."""
    folder = model_dir.parent if model_dir.name.isdigit() else model_dir
    run_warmup(handler, warmup_samples(handler.config, folder))


def run_warmup(handler: Handler, samples: list[WarmupSample]) -> None:
    """Run every sample ``count`` times, as one batch of its requests; the first failure is
    raised as Triton reports it: ``failed to run warmup sample '<name>': <message>``."""
    runner = batch_runner(handler)
    for sample in samples:
        for iteration in range(1, sample.count + 1):
            logger.info(
                "model '%s' is running warmup sample '%s' for iteration %d",
                handler.config.name,
                sample.name,
                iteration,
            )
            try:
                outcomes: list[object] = list(runner.run_batch(sample.parts))
            except Exception as exc:
                outcomes = [exc]
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    message = str(outcome.args[0]) if outcome.args else str(outcome)
                    raise WarmupFailed(
                        f"failed to run warmup sample '{sample.name}': {message}"
                    ) from outcome


def _inputs(
    config: ModelConfig, sample: str, given: dict[str, Any], model_folder: Path
) -> dict[str, np.ndarray]:
    specs = {spec.name: spec for spec in config.inputs}
    for name in given:
        if name not in specs:
            raise WarmupFailed(
                f"warmup sample '{sample}': input '{name}' is not an input of model "
                f"'{config.name}' (its inputs: {', '.join(specs)})"
            )
    missing = [name for name, spec in specs.items() if name not in given and not spec.optional]
    if missing:
        raise WarmupFailed(
            f"warmup sample '{sample}': expected {len(specs)} inputs but got {len(given)} "
            f"inputs for model '{config.name}' (missing: {', '.join(missing)})"
        )
    tensors = {}
    for name, meta in given.items():
        row = _TYPES.get(str(meta.get("data_type", "TYPE_INVALID")))
        spec = specs[name]
        if row is None or row.name != spec.datatype:
            found = row.name if row is not None else meta.get("data_type")
            raise WarmupFailed(
                f"warmup sample '{sample}': inference input '{name}' data-type is '{found}', "
                f"but model '{config.name}' expects '{spec.datatype}'"
            )
        dims = tuple(int(d) for d in meta.get("dims", []))
        if any(d < 0 for d in dims):
            raise WarmupFailed(
                "warmup setting expects all variable-size dimensions are specified for input "
                f"'{name}'"
            )
        array = _data(name, meta, row.numpy, row.byte_size, dims, model_folder)
        if not spec.shape and dims == (1,):
            array = array.reshape(())  # Triton's scalar sample: dims [1] reshaped to []
        tensors[name] = array[np.newaxis]  # one request's rows (or its one sample)
    return tensors


def _data(
    name: str,
    meta: dict[str, Any],
    dtype: np.dtype[Any],
    byte_size: int,
    dims: tuple[int, ...],
    model_folder: Path,
) -> np.ndarray:
    count = int(np.prod(dims, dtype=np.int64))
    strings = dtype == np.object_
    if "zero_data" in meta or ("random_data" in meta and strings):
        # Triton sends strings as zero bytes for random data too: empty strings.
        if strings:
            array = np.empty(count, dtype=np.object_)
            array[:] = [b""] * count
            return array.reshape(dims)
        return np.zeros(dims, dtype=dtype)
    if "random_data" in meta:
        generator = np.random.default_rng(0)
        if dtype == np.bool_:
            return generator.integers(0, 2, dims).astype(np.bool_)
        raw = generator.integers(0, 256, count * byte_size, dtype=np.uint8).tobytes()
        return np.frombuffer(raw, dtype=dtype).reshape(dims).copy()
    if "input_data_file" in meta:
        file = str(meta["input_data_file"])
        path = model_folder / WARMUP_FOLDER / file
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise WarmupFailed(f"unable to read warmup data file '{path}': {exc}") from exc
        if strings:
            items = deserialize_bytes_tensor(data)
            if len(items) < count:
                raise WarmupFailed(
                    f"warmup setting expects {count} strings, but the data provided from {file} "
                    f"only has {len(items)}"
                )
            return items[:count].reshape(dims)
        needed = count * byte_size
        if needed > len(data):
            raise WarmupFailed(
                f"warmup setting expects {needed} bytes, but the data provided from {file} only "
                f"has {len(data)} bytes"
            )
        little = np.frombuffer(data[:needed], dtype=dtype.newbyteorder("<"))
        return little.astype(dtype).reshape(dims)
    raise WarmupFailed(f"warmup setting expects input '{name}' to have input_data_type set")
