"""A model's memory profile remembered in the engine cache beside its engine choice, so a model
loaded again (a restart, a reload, an on-demand load after an eviction) is planned from the
record instead of running its profiling batches again: on CPU they are most of a start's work.

The record is keyed by everything the measurement depends on: what the engine choice is keyed by
(torch's version and ONNX Runtime's where it serves, the device type, config, code and weights by
value, the batch cap), nograd's version and the record's layout, the device's name, the engines
serving each range of batch sizes and the intra-op threads the batches ran with. Any change
profiles again, and so does a record that cannot be read or is of another layout.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import torch

from nograd import __version__
from nograd.core.engines import ENGINES
from nograd.runtime.engines.artifacts import cache_file, onnxruntime_version, write_text_atomically
from nograd.runtime.engines.errors import ArtifactError
from nograd.runtime.engines.paths import serving_ranges
from nograd.runtime.memory import CheckPoint, CostModel, MemoryProbe, Profile
from nograd.runtime.memory.fits import RangedCost, RangeFit, Verdict, VerifiedFit
from nograd.runtime.planner import profile_handler
from nograd.runtime.runners import Handler

logger = logging.getLogger(__name__)

FORMAT: Final = 1
"""The record's layout (and the profiling method's): a record of another is profiled again."""


def profile_key(handler: Handler, loaded_as: str) -> str:
    """What the handler's measured activation cost depends on: ``loaded_as`` (``model_key``, taken
    at load before its engines were installed, when the eager module still held the weights) and
    what serves it now. Runs on the device's thread, after its engines are installed."""
    digest = hashlib.sha256()
    device = handler.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    engines = [(most, engine.name) for most, engine in serving_ranges(handler)]
    # ONNX Runtime's version only where it serves: reading it imports it, tens of MiB that a
    # model served by torch alone would otherwise carry (and count as its memory).
    onnx = {row.name for row in ENGINES if row.suffix == ".onnx"}
    library = onnxruntime_version() if onnx & {engine for _, engine in engines} else ""
    for part in (
        str(FORMAT),
        __version__,
        loaded_as,
        library,
        device_name,
        json.dumps(engines),
        str(torch.get_num_threads()),
    ):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:24]


def profile_or_recall(
    handler: Handler,
    probe: MemoryProbe,
    cap: int,
    loaded_as: str,
    cache_dir: Path,
    stop: Callable[[], bool] | None = None,
) -> RangedCost:
    """The handler's cost as remembered for the same key, or profiled now (``profile_handler``,
    given up when ``stop`` says so) and remembered; runs on the device's thread, as profiling
    does. A model with no ``loaded_as`` (one that is not a torch module, whose weights were not
    hashed) is profiled and not remembered."""
    if not loaded_as:
        return profile_handler(handler, probe, cap, stop)
    known = remembered(handler, loaded_as, cache_dir)
    if known is not None:
        return known
    cost = profile_handler(handler, probe, cap, stop)
    if not refused(cost):
        config = handler.config
        key = profile_key(handler, loaded_as)
        remember(cache_dir, f"{config.name}-v{config.version}", key, cost)
    return cost


def refused(cost: RangedCost) -> bool:
    """Whether a range's fit failed its checks: a measurement that did not hold (another
    process's work can disturb one) is never remembered, so the next load measures again
    instead of serving none of that range for good."""
    return any(item.fit.verdict is Verdict.REFUSED for item in cost.ranges)


def is_remembered(handler: Handler, loaded_as: str, cache_dir: Path) -> bool:
    """Whether ``remembered`` would find the handler's cost (read, not logged): a load that
    will be planned on it need not measure its warm-up batches."""
    if not loaded_as:
        return False
    config = handler.config
    label = f"{config.name}-v{config.version}"
    return recall(cache_dir, label, profile_key(handler, loaded_as)) is not None


def remembered(handler: Handler, loaded_as: str, cache_dir: Path) -> RangedCost | None:
    """The handler's cost as an earlier load measured it (None when none is remembered for the
    same key, or with no ``loaded_as``); runs on the device's thread, after its engines are
    installed."""
    if not loaded_as:
        return None
    config = handler.config
    known = recall(cache_dir, f"{config.name}-v{config.version}", profile_key(handler, loaded_as))
    if known is not None:
        logger.info(
            "model %s: memory profile as measured at an earlier load (the engine cache holds it "
            "for these files, engines and versions); not profiled again",
            config.name,
        )
    return known


def _record_path(cache_dir: Path, label: str, key: str) -> Path:
    return cache_file(cache_dir, f"{label}-profile-{key}.json")


def recall(cache_dir: Path, label: str, key: str) -> RangedCost | None:
    """The remembered cost, or None when there is none, it cannot be read as this layout, or a
    fit of it was refused (kept out since, as measurements that did not hold)."""
    try:
        document = json.loads(_record_path(cache_dir, label, key).read_text("utf-8"))
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            return None
        cost = cost_from(document["ranges"])
    except (OSError, ArtifactError, ValueError, KeyError, TypeError):
        return None
    return None if refused(cost) else cost


def remember(cache_dir: Path, label: str, key: str, cost: RangedCost) -> None:
    """Write the record atomically; a cache that cannot be written only costs the next load."""
    document = {"format": FORMAT, "ranges": cost_document(cost)}
    try:
        write_text_atomically(_record_path(cache_dir, label, key), json.dumps(document))
    except (OSError, ArtifactError) as exc:
        logger.warning("engine cache: could not remember the memory profile (%s)", exc)


def cost_document(cost: RangedCost) -> list[dict[str, Any]]:
    """The cost as JSON: each range's engine, its largest batch and its checked fit."""
    return [
        {
            "engine": item.engine,
            "most_rows": item.most_rows,
            "verdict": item.fit.verdict.value,
            "errors": list(item.fit.errors),
            "model": _model_document(item.fit.model),
            "points": [list(point) for point in item.fit.profile.points],
            "fitted": _model_document(item.fit.profile.model),
            "check": {
                "rows": item.fit.profile.check_point.rows,
                "length": item.fit.profile.check_point.length,
                "measured_bytes": item.fit.profile.check_point.measured_bytes,
                "predicted_bytes": item.fit.profile.check_point.predicted_bytes,
            },
        }
        for item in cost.ranges
    ]


def cost_from(document: list[dict[str, Any]]) -> RangedCost:
    """The cost ``cost_document`` wrote; a malformed one raises ValueError, KeyError or
    TypeError."""
    ranges = []
    for row in document:
        points = tuple((int(r), int(n), int(m)) for r, n, m in row["points"])
        check = CheckPoint(**row["check"])
        profile = Profile(points, _model_from(row["fitted"]), check)
        fit = VerifiedFit(
            profile,
            Verdict(row["verdict"]),
            tuple(float(error) for error in row["errors"]),
            _model_from(row["model"]),
        )
        most = row["most_rows"]
        ranges.append(RangeFit(str(row["engine"]), None if most is None else int(most), fit))
    return RangedCost(tuple(ranges))


def _model_document(model: CostModel) -> dict[str, float]:
    return {"fixed": model.fixed, "per_unit": model.per_unit, "quadratic": model.quadratic}


def _model_from(document: dict[str, Any]) -> CostModel:
    return CostModel(
        float(document["fixed"]), float(document["per_unit"]), float(document["quadratic"])
    )
