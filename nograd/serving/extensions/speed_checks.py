"""The serving side of the speed-mode guard: the accuracy sample read from its V2 body, and the
guard's measurements exported as metrics (the runtime knows neither the wire format nor metrics)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from nograd.core.datatypes import datatype_of, shape_matches
from nograd.observability.metrics import Metrics
from nograd.protocol.v2 import decode_body
from nograd.runtime.handler import ModelHandler, TensorPart
from nograd.runtime.loader import LoadError, inside
from nograd.runtime.speed.guard import SpeedCheck


def load_accuracy_sample(handler: ModelHandler, model_dir: Path) -> TensorPart | None:
    """The config's ``accuracy_sample``: a V2 request body, decoded and prepared as a request;
    None when the config names none.

    A sample that cannot be read fails the load, naming the file and the field, like any other
    config mistake.
    """
    name = handler.config.accuracy_sample
    if name is None:
        return None
    path = model_dir / name
    try:
        inside(model_dir, path)
        request = decode_body(path.read_bytes(), None)
        declared = sorted(spec.name for spec in handler.config.inputs)
        if sorted(request.inputs) != declared:
            raise ValueError(f"has inputs {sorted(request.inputs)}, the model takes {declared}")
        for spec in handler.config.inputs:
            array = request.inputs[spec.name]
            actual = datatype_of(array)
            if actual != spec.datatype or not shape_matches(spec.shape, tuple(array.shape[1:])):
                raise ValueError(
                    f"input {spec.name!r} is {actual} {list(array.shape)}; the model takes "
                    f"{spec.datatype} [-1, {', '.join(map(str, spec.shape))}]"
                )
        return handler.prepare(request.inputs)
    except (OSError, ValueError, LoadError) as exc:
        raise ValueError(f"{path}: field 'accuracy_sample': {exc}") from exc


def recorder(metrics: Metrics) -> Callable[[SpeedCheck], None]:
    """Exports a speed check's numbers: accuracy delta, minimum cosine and speed-up per mode."""

    def record(check: SpeedCheck) -> None:
        labels = (check.model, check.mode)
        metrics.accuracy_delta.labels(*labels).set(check.accuracy.max_abs_error)
        metrics.accuracy_cosine_min.labels(*labels).set(check.accuracy.min_cosine)
        if check.speed is not None:
            metrics.speedup.labels(*labels).set(check.speed.speedup)

    return record
