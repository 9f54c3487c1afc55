"""Which engine runs a python model's forward, decided at load by measurement.

``engine = "eager"`` keeps torch eager (with the config's speed mode). An engine named alone
(``onnx``, ``torch_export``, ``aoti``) is built from the eager model, checked against fp32 eager
on the accuracy guard's batches, timed against eager on the timing batches, and serves when it is
accurate and at least ``min_speedup`` times as fast; eager serves otherwise. ``auto`` builds
every engine in ``engines``, drops the inaccurate ones and serves, for each range of batch sizes,
the one timed fastest there (eager keeps a size unless another engine beats it by
``SWITCH_MARGIN``, so timing noise does not switch engines). Built artifacts are cached by
content, so only the first start pays for exporting and compiling.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch

from nograd.core.engines import AUTO, EAGER, engine_row, int8_variant
from nograd.runtime.engines.artifacts import artifact_file, cache_key, cached, write_artifact
from nograd.runtime.engines.paths import EagerPath, EnginePath, RangePath
from nograd.runtime.engines.registry import engine, open_engine
from nograd.runtime.engines.remembered import (
    Remembered,
    choice_key,
    recall,
    remember,
    report_from,
)
from nograd.runtime.engines.trace import Traced, export_program
from nograd.runtime.handler import ModelHandler, TensorPart, TorchRunner
from nograd.runtime.speed.accuracy import AccuracyReport, compare
from nograd.runtime.speed.guard import (
    SPEED_PASSES,
    SpeedCheck,
    SpeedReport,
    apply_speed,
    check_batches,
    first_line,
    run_all,
)
from nograd.runtime.speed.mode import FP32_TOLERANCE, mode_for
from nograd.schema.config import ModelConfig, chooses_engine

logger = logging.getLogger(__name__)

SWITCH_MARGIN: Final = 1.05
"""Another engine takes a batch size from eager only when it runs it this much faster."""
TIMING_SEED: Final = 2
"""``ModelHandler.example`` seed of the timing batches (0 warms up, 1 is the held-out check)."""
TIMING_ROWS: Final = (1, 4, 16, 32)
"""Batch sizes (rows) timed for token models; sample models add their batch limit."""
TIMING_LENGTHS: Final = (8, 48)
"""Token models: texts of lengths spread over this range, as one-sentence requests have them, so
a forward that skips padding is timed on the padding real batches carry."""


@dataclass(frozen=True)
class EngineResult:
    """One engine's row of the load-time table."""

    engine: str
    accuracy: AccuracyReport | None = None
    seconds: tuple[float, ...] | None = None
    """Fastest pass of each timing batch, in ``EngineTable.rows`` order."""
    refused: str | None = None


@dataclass(frozen=True)
class EngineTable:
    """What the choice measured; ``serving`` is (largest rows, engine) per range, ascending."""

    model: str
    rows: tuple[int, ...]
    eager: EngineResult
    engines: tuple[EngineResult, ...]
    serving: tuple[tuple[int, str], ...]

    @property
    def label(self) -> str:
        """The ``mode`` label of what serves: ``onnx``, or ``onnx<=4,eager`` for ranges."""
        if len(self.serving) == 1:
            return self.serving[0][1]
        parts = [f"{name}<={most}" for most, name in self.serving[:-1]]
        return ",".join([*parts, self.serving[-1][1]])

    def log_rows(self) -> list[dict[str, object]]:
        """The table as log rows: engine, accuracy against fp32 eager, milliseconds per timed
        batch size (``rows_8_ms``: a batch of 8 rows), and why an engine was refused."""
        out: list[dict[str, object]] = []
        for result in (self.eager, *self.engines):
            accuracy = result.accuracy
            row: dict[str, object] = {
                "engine": result.engine,
                "max_abs_error": None if accuracy is None else accuracy.max_abs_error,
                "min_cosine": None if accuracy is None else accuracy.min_cosine,
            }
            for size, seconds in zip(self.rows, result.seconds or (), strict=False):
                row[f"rows_{size}_ms"] = round(1e3 * seconds, 3)
            row["refused"] = result.refused
            out.append(row)
        return out


def candidates(config: ModelConfig, device: torch.device) -> list[str]:
    """The engines to build besides eager: ``engines`` for auto, else the one named. With
    ``precision = "int8"`` an engine's quantised variant too (alone when the engine is named),
    where it runs on ``device``."""
    chosen = config.engine or EAGER
    auto = chosen == AUTO
    names = list(config.engines) if auto else [chosen]
    out: list[str] = []
    for name in names:
        if name == EAGER:
            continue
        variant = int8_variant(name) if config.precision == "int8" else None
        if variant is not None:
            why = engine(variant).unsupported(device)
            if why is None:
                out.append(variant)
            else:
                logger.warning("model %s: %s not built: %s", config.name, variant, why)
            if not auto:
                continue
        out.append(name)
    return out


def tolerance_for(name: str, config: ModelConfig) -> float:
    """int8 is judged on cosine (and labels); fp32 engines on fp32's rounding, like compile."""
    if config.accuracy_tolerance is not None:
        return config.accuracy_tolerance
    return math.inf if engine_row(name).int8_of is not None else FP32_TOLERANCE


def timing_batches(handler: ModelHandler, limit: int) -> list[tuple[int, list[TensorPart]]]:
    """(rows, parts) per timed batch: batch 1 and the sizes the model will serve."""
    if handler.config.batch_unit != "tokens":
        sizes = sorted({rows for rows in (1, 8, 32, limit) if rows <= limit})
        return [(rows, [handler.example(rows, seed=TIMING_SEED)]) for rows in sizes]
    generator = np.random.default_rng(TIMING_SEED)
    low, high = TIMING_LENGTHS
    batches = []
    for rows in TIMING_ROWS:
        if rows * high > limit and rows > 1:
            continue
        lengths = generator.integers(low, high + 1, size=rows)
        parts = [handler.example(1, int(n), seed=TIMING_SEED + i) for i, n in enumerate(lengths)]
        batches.append((rows, parts))
    return batches


def time_parts(
    runner: TorchRunner, batches: Sequence[tuple[int, list[TensorPart]]], passes: int = SPEED_PASSES
) -> tuple[float, ...]:
    """Seconds of each batch at its fastest of ``passes`` passes (noise only slows a pass)."""
    best = [math.inf] * len(batches)
    for _ in range(passes):
        for index, (_, parts) in enumerate(batches):
            started = time.perf_counter()
            runner.run_batch(parts)
            best[index] = min(best[index], time.perf_counter() - started)
    return tuple(best)


def build_engine(
    name: str,
    traced: Traced,
    handler: ModelHandler,
    code: Sequence[Path],
    cache_dir: Path,
) -> EnginePath:
    """Engine ``name``'s artifact for ``traced`` from the cache (built first if missing),
    opened."""
    config = handler.config
    why = engine(name).unsupported(handler.device)
    if why is not None:
        raise RuntimeError(why)
    key = cache_key(name, traced, code, handler.device)
    label = f"{config.name}-v{config.version}"
    started = time.perf_counter()
    path = cached(cache_dir, label, name, key, lambda target: write_artifact(name, traced, target))
    built = time.perf_counter() - started
    if built > 0.5:
        logger.info("model %s: built the %s engine in %.1fs: %s", config.name, name, built, path)
    opened = open_engine(name, path, handler.device)
    opened.check_inputs(handler)
    return opened


def prepare_engine(
    handler: ModelHandler,
    limit: int,
    sample: TensorPart | None,
    report_check: Callable[[SpeedCheck], None] | None,
    code: Sequence[Path],
    cache_dir: Path,
    digest: str | None = None,
) -> ModelHandler:
    """The handler to serve, running the engine(s) its config asks for and measurement picks;
    ``digest``: the model's (``model_digest``), when its load already hashed it.

    A model in an artifact format already runs its artifact (the loader set it up), a TorchScript
    one unless it opted in (its TorchScript module is then the eager forward), and one with
    ``engine = "eager"`` gets its speed mode alone (``apply_speed``).
    """
    config = handler.config
    if not chooses_engine(config):
        return handler
    chosen = config.engine or EAGER
    if chosen == EAGER:
        return apply_speed(handler, limit, sample, report_check)
    label = f"{config.name}-v{config.version}"
    key = choice_key(handler, limit, code, digest)
    known = recall(cache_dir, label, key)
    if known is not None:
        return _install_remembered(handler, known, limit, sample, report_check)
    plan = replace(mode_for(config, handler.device), buckets=None)
    batches = check_batches(handler, plan, limit, sample)
    reference = run_all(TorchRunner(handler), batches)
    names = candidates(config, handler.device)
    built, results, artifacts = _build_all(handler, names, batches, reference, code, cache_dir)
    handler = apply_speed(handler, limit, sample, report_check)
    eager_path = EagerPath(handler, handler.speed_path)
    timing = timing_batches(handler, limit)
    eager = EngineResult(eager_path.name, seconds=_time_engine(handler, eager_path, timing))
    timed = []
    for result in results:
        path = built.get(result.engine)
        if path is not None:
            result = replace(result, seconds=_time_engine(handler, path, timing))
        timed.append(result)
    rows = tuple(rows for rows, _ in timing)
    serving = ranges(rows, _choose(chosen == AUTO, config, eager, timed))
    table = EngineTable(config.name, rows, eager, tuple(timed), serving)
    _install(handler, {eager.engine: eager_path, **built}, table)
    _report(table, report_check)
    remember(cache_dir, label, key, dataclasses.asdict(table), artifacts)
    return handler


def _install_remembered(
    handler: ModelHandler,
    known: Remembered,
    limit: int,
    sample: TensorPart | None,
    report_check: Callable[[SpeedCheck], None] | None,
) -> ModelHandler:
    """Serve the choice an earlier load measured on the same files and versions: its engines
    opened from the cache, nothing exported, built, checked or timed again."""
    table = _table_from(known.table)
    serving = {name for _, name in table.serving}
    opened: dict[str, EnginePath] = {}
    for name in serving - {table.eager.engine}:
        opened[name] = open_engine(name, known.artifacts[name], handler.device)
        opened[name].check_inputs(handler)
    if table.eager.engine in serving:
        handler = apply_speed(handler, limit, sample, report_check)
    _install(handler, {table.eager.engine: EagerPath(handler, handler.speed_path), **opened}, table)
    logger.info(
        "model %s: engines as chosen at an earlier load (the engine cache holds the choice for "
        "these files and versions); serving %s",
        table.model,
        table.label,
    )
    _report(table, report_check, log=False)
    return handler


def _table_from(document: dict[str, Any]) -> EngineTable:
    def result(row: dict[str, Any]) -> EngineResult:
        seconds = row.get("seconds")
        return EngineResult(
            row["engine"],
            report_from(row.get("accuracy")),
            tuple(seconds) if seconds is not None else None,
            row.get("refused"),
        )

    return EngineTable(
        document["model"],
        tuple(document["rows"]),
        result(document["eager"]),
        tuple(result(row) for row in document["engines"]),
        tuple((int(most), str(name)) for most, name in document["serving"]),
    )


def _time_engine(
    handler: ModelHandler, path: EnginePath, timing: Sequence[tuple[int, list[TensorPart]]]
) -> tuple[float, ...]:
    """``path``'s seconds on the timing batches, run as the batcher runs them."""
    return time_parts(TorchRunner(handler, path=path), timing)


def _build_all(
    handler: ModelHandler,
    names: Sequence[str],
    batches: Sequence[object],
    reference: Sequence[dict[str, np.ndarray]],
    code: Sequence[Path],
    cache_dir: Path,
) -> tuple[dict[str, EnginePath], list[EngineResult], dict[str, Path]]:
    """Each engine built, opened and checked against fp32 eager: accepted ones, every row, and
    the accepted ones' artifacts in the cache."""
    config = handler.config
    built: dict[str, EnginePath] = {}
    artifacts: dict[str, Path] = {}
    results: list[EngineResult] = []
    traced: Traced | None = None
    export_error = ""
    if names:
        try:
            traced = export_program(handler)
        except Exception as exc:
            export_error = f"torch.export failed: {first_line(exc)}"
            logger.debug("model %s: torch.export failure", config.name, exc_info=True)
    for name in names:
        if traced is None:
            results.append(EngineResult(name, refused=export_error))
            continue
        try:
            path = build_engine(name, traced, handler, code, cache_dir)
            candidate = run_all(TorchRunner(handler, path=path), batches)  # type: ignore[arg-type]
            report = compare(reference, candidate)
        except Exception as exc:
            results.append(EngineResult(name, refused=first_line(exc)))
            logger.debug("model %s: engine %s failure", config.name, name, exc_info=True)
            continue
        problems = report.problems(
            tolerance_for(name, config), config.min_cosine, config.min_match_rate
        )
        if problems:
            results.append(EngineResult(name, report, refused="; ".join(problems)))
            continue
        built[name] = path
        key = cache_key(name, traced, code, handler.device)
        artifacts[name] = artifact_file(cache_dir, f"{config.name}-v{config.version}", name, key)
        results.append(EngineResult(name, report))
    return built, results, artifacts


def _choose(
    auto: bool, config: ModelConfig, eager: EngineResult, engines: Sequence[EngineResult]
) -> list[str]:
    """The engine for each timed batch size: the fastest accepted one (auto), or the named
    engine everywhere when it runs at least ``min_speedup`` times eager's speed over all sizes."""
    assert eager.seconds is not None
    accepted = [r for r in engines if r.refused is None and r.seconds is not None]
    sizes = len(eager.seconds)
    if not accepted:
        return [eager.engine] * sizes
    if not auto:
        engine = accepted[0]
        assert engine.seconds is not None
        speedup = sum(eager.seconds) / max(sum(engine.seconds), 1e-12)
        return [engine.engine if speedup >= config.min_speedup else eager.engine] * sizes
    eager_allowed = EAGER in config.engines
    winners = []
    for index in range(sizes):
        best, best_seconds = "", math.inf
        if eager_allowed:
            best, best_seconds = eager.engine, eager.seconds[index] / SWITCH_MARGIN
        for result in accepted:
            assert result.seconds is not None
            if result.seconds[index] < best_seconds:
                best, best_seconds = result.engine, result.seconds[index]
        winners.append(best)
    return winners


def ranges(rows: Sequence[int], winners: Sequence[str]) -> tuple[tuple[int, str], ...]:
    """Consecutive timed sizes with the same winner merged: (largest rows, engine), ascending;
    the last range takes every larger batch too."""
    merged: list[tuple[int, str]] = []
    for size, name in zip(rows, winners, strict=True):
        if merged and merged[-1][1] == name:
            merged[-1] = (size, name)
        else:
            merged.append((size, name))
    return tuple(merged)


def _install(handler: ModelHandler, opened: dict[str, EnginePath], table: EngineTable) -> None:
    """Serve what the table chose: eager as ``apply_speed`` left it, one engine, or ranges."""
    names = {name for _, name in table.serving}
    if names == {table.eager.engine}:
        return  # eager with its speed mode, as apply_speed left it
    if len(table.serving) == 1:
        handler.speed_path = opened[table.serving[0][1]]
    else:
        handler.speed_path = RangePath([(most, opened[name]) for most, name in table.serving])
        for name in names:
            opened[name].take_turns()
    if table.eager.engine not in names:
        # Eager serves no batch: its weights, casts and layouts go (the engines hold their own).
        handler.module = None
        handler.compute_dtype = torch.float32
        handler.memory_format = torch.contiguous_format
    handler.speed_mode = table.label


def _report(
    table: EngineTable, report_check: Callable[[SpeedCheck], None] | None, log: bool = True
) -> None:
    if log:
        logger.info(
            "model %s: engines measured at load (fastest pass of %d, against fp32 eager); "
            "serving %s",
            table.model,
            SPEED_PASSES,
            table.label,
            extra={"table": table.log_rows()},
        )
    if report_check is None or table.eager.seconds is None:
        return
    for result in table.engines:
        if result.accuracy is None:
            continue
        speed = None
        if result.seconds is not None:
            speed = SpeedReport(table.eager.seconds, result.seconds)
        report_check(SpeedCheck(table.model, result.engine, result.accuracy, speed))
