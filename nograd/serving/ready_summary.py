"""The start-up summary: once the start-up set of models has loaded, one record that says what
the process serves and what its start took.

One row per model version: its format, the engine that serves it, its device, its batch limit,
its memory (the weights as loaded, and a batch at the limit as its measured cost predicts), its
state, and how long each step of its load took (building it, choosing its engine, warming it up,
measuring its memory). The record's own fields time the process: since it started (the imports
included), the repository scan, and loading every model. Through the log formatters a JSON log
carries one object per row, a terminal an aligned table (``nograd.observability.log_tables``).

With several worker processes the first worker's summary is the one at INFO (every worker serves
the same models); the others log theirs at DEBUG, naming their worker.
"""

from __future__ import annotations

import logging

from nograd.host.readings import process_age_s
from nograd.runtime.devices import device_label
from nograd.runtime.engines.paths import serving_ranges
from nograd.serving.registry import ModelRegistry, ServedModel

logger = logging.getLogger(__name__)


def model_format(model: ServedModel) -> str:
    """What the model was served from, as its format names it: nograd's own folder format
    (``python``, an engine's artifact), or a Triton model folder (``triton/...``)."""
    return model.format.label(model.config)


def engine_label(model: ServedModel) -> str | None:
    """The engine that runs each range of batch sizes: ``onnx``, or ``onnx<=4,eager``."""
    if model.handler is None:
        return None
    parts = [
        path.name if most is None else f"{path.name}<={most}"
        for most, path in serving_ranges(model.handler)
    ]
    return ",".join(parts)


def summary_row(model: ServedModel) -> dict[str, object]:
    """One model version's row: what serves it, its limit and memory, each step's seconds."""
    handler, plan, batcher = model.handler, model.plan, model.batcher
    limit = batcher.limit.current if batcher is not None else None
    batch_bytes = None
    if plan is not None and plan.limit > 0:
        batch_bytes = round(plan.predict_bytes(plan.limit_rows, plan.limit))
    return {
        "model": model.name,
        "version": model.version,
        "state": model.state.value,
        "format": model_format(model),
        "engine": engine_label(model),
        "device": None if handler is None else device_label(handler.device),
        "limit": limit,
        "unit": None if limit is None else model.config.batch_unit,
        "weights_bytes": None if handler is None else model.weights_bytes,
        "batch_bytes": batch_bytes,
        "build_s": _seconds(model.phases.get("build")),
        "engines_s": _seconds(model.phases.get("engines")),
        "warmup_s": _seconds(model.warmup_seconds if handler is not None else None),
        "profile_s": _seconds(model.phases.get("profile")),
    }


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def log_ready(
    registry: ModelRegistry, *, scan_s: float, load_s: float, worker: int | None = None
) -> None:
    """Log the summary of what this process serves (at DEBUG for a worker after the first)."""
    rows = [summary_row(model) for model in registry.served()]
    ready = sum(1 for row in rows if row["state"] == "ready")
    fields: dict[str, object] = {} if worker is None else {"worker": worker}
    since_start = process_age_s()
    if since_start is not None:
        fields["since_start_s"] = round(since_start, 3)
    fields.update(scan_s=round(scan_s, 3), load_s=round(load_s, 3), table=rows)
    # Under on-demand control most of the repository loads later; each is counted, not listed.
    others = sum(1 for name in registry.unloaded if name not in registry.versions)
    logger.log(
        logging.INFO if worker in (None, 0) else logging.DEBUG,
        "ready: serving %d of %d model versions%s",
        ready,
        len(rows),
        f"; {others} more in the repository, not loaded" if others else "",
        extra=fields,
    )
