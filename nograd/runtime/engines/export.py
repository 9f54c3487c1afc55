"""``nograd export``: a python model folder turned into a model folder holding an artifact.

The artifact is checked against the eager model it came from (the accuracy guard's batches and
limits) before the folder is written, so a folder this writes serves what the python model
served, within the guard.
"""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

import torch
import yaml

from nograd.core.engines import artifact_engines, built_engines, engine_row, int8_variant
from nograd.runtime.engines.artifacts import sha256_of, write_artifact
from nograd.runtime.engines.choice import tolerance_for
from nograd.runtime.engines.errors import ArtifactError
from nograd.runtime.engines.registry import open_engine
from nograd.runtime.engines.trace import export_program
from nograd.runtime.handler import ModelHandler, TorchRunner
from nograd.runtime.loader import LoadError, build_handler
from nograd.runtime.speed.accuracy import AccuracyReport, compare
from nograd.runtime.speed.guard import check_batches, run_all
from nograd.runtime.speed.mode import mode_for
from nograd.schema.config import (
    CONFIG_NAMES,
    ConfigError,
    ModelConfig,
    find_config,
    load_config,
)

KEPT_FIELDS: Final = (
    "version",
    "version_policy",
    "platform",
    "inputs",
    "outputs",
    "max_batch_size",
    "max_queue_delay_ms",
    "max_queue_size",
    "device",
    "batch_unit",
    "max_batch_tokens",
    "reject_non_finite",
)
"""What the written config keeps of the python model's: its interface and batching, not its
code, weights, engine or speed-mode fields (the artifact replaces them)."""


class ExportError(Exception):
    """An export that cannot be done or was refused by the check; the message says why."""


@dataclass(frozen=True)
class Exported:
    folder: Path
    artifact: Path
    accuracy: AccuracyReport
    batches: int


def export_model(
    model_dir: Path, to: str, out: Path | None = None, precision: str = "fp32", device: str = "cpu"
) -> Exported:
    """Write ``out`` (default: ``<name>-<to>`` beside ``model_dir``) with the artifact, a config
    and, when the model has a handler of its own, its code."""
    if to not in built_engines():
        raise ExportError(f"--to must be one of {', '.join(built_engines())}, got {to!r}")
    variant = int8_variant(to) if precision == "int8" else to
    if variant is None:
        quantising = [name for name in artifact_engines() if int8_variant(name) is not None]
        raise ExportError(f"--precision int8 is for --to {' or '.join(quantising)}")
    config_path = find_config(model_dir)
    if config_path is None:
        raise ExportError(f"{model_dir}: no config file ({', '.join(CONFIG_NAMES)})")
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        raise ExportError(str(exc)) from exc
    if not config.from_code:
        raise ExportError(f"{config_path}: already a {config.format} artifact")
    engine = variant
    target_device = torch.device(device)
    try:
        handler = build_handler(model_dir.parent, model_dir, config, target_device)
    except LoadError as exc:
        raise ExportError(str(exc)) from exc
    if not isinstance(handler, ModelHandler):
        raise ExportError(f"{config_path}: the model runs its batches as its own code, no forward")
    name = f"{config.name}-{to}" + ("-int8" if precision == "int8" else "")
    folder = out if out is not None else model_dir.parent / name
    artifact = folder / f"model{engine_row(engine).suffix}"
    traced = export_program(handler)
    write_artifact(engine, traced, artifact)
    try:
        accuracy, batches = _check(handler, engine, artifact, target_device)
    except Exception:
        artifact.unlink(missing_ok=True)
        raise
    code = model_dir / config.module
    keeps_code = _defines_handler(code)
    if keeps_code:
        shutil.copyfile(code, folder / config.module)
    _write_config(folder, config, to, artifact, keeps_code)
    return Exported(folder, artifact, accuracy, batches)


def _check(
    handler: ModelHandler, engine: str, artifact: Path, device: torch.device
) -> tuple[AccuracyReport, int]:
    """The artifact's outputs against the eager model's on the accuracy guard's batches."""
    config = handler.config
    limit = (
        config.max_batch_tokens or 8192
        if config.batch_unit == "tokens"
        else config.max_batch_size or 32
    )
    plan = replace(mode_for(config, device), buckets=None)
    batches = check_batches(handler, plan, limit)
    reference = run_all(TorchRunner(handler), batches)
    path = open_engine(engine, artifact, device)
    path.check_inputs(handler)
    report = compare(reference, run_all(TorchRunner(handler, path=path), batches))
    problems = report.problems(
        tolerance_for(engine, config), config.min_cosine, config.min_match_rate
    )
    if problems:
        raise ArtifactError(
            f"{artifact}: refused, against eager: {'; '.join(problems)} ({report.summary()})"
        )
    return report, len(batches)


def _defines_handler(code: Path) -> bool:
    """Whether the model's code defines ``build_handler`` (pre- and post-processing to keep)."""
    if not code.is_file():
        return False
    tree = ast.parse(code.read_text(encoding="utf-8"))
    return any(
        isinstance(node, ast.FunctionDef) and node.name == "build_handler" for node in tree.body
    )


def _write_config(
    folder: Path, config: ModelConfig, to: str, artifact: Path, keeps_code: bool
) -> None:
    for stale in CONFIG_NAMES:
        (folder / stale).unlink(missing_ok=True)
    fields = config.model_dump(mode="json", include=set(KEPT_FIELDS), exclude_defaults=True)
    written: dict[str, object] = {
        "format": to,
        "artifact": artifact.name,
        "artifact_sha256": sha256_of(artifact),
        **({"module": config.module} if keeps_code else {}),
        "weights": "",
        **fields,
        "inputs": [spec.model_dump(mode="json") for spec in config.inputs],
        "outputs": [spec.model_dump(mode="json") for spec in config.outputs],
    }
    header = (
        f"# Written by nograd export from model {config.name!r} v{config.version}: the {to} "
        "artifact, checked against the eager model.\n"
    )
    (folder / "config.yaml").write_text(
        header + yaml.safe_dump(written, sort_keys=False), encoding="utf-8"
    )
