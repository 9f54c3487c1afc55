"""Each engine's raw forward speed (no HTTP) at batch 1 and 32, for the engines table of
``make bench`` and docs/speed.md: ``python -m bench.engine_speed [--json]``.

The engines are built from the shipped models exactly as ``engine = "auto"`` builds them (the
same export, artifacts and engine cache), then timed through the handler's runner, collate and
copy back included; minilm batches are texts of 8-48 tokens padded to the longest.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nograd.runtime.engines.choice import build_engine, time_parts
from nograd.runtime.engines.trace import export_program
from nograd.runtime.handler import ModelHandler, TensorPart, TorchRunner
from nograd.runtime.loader import build_handler
from nograd.runtime.speed.accuracy import compare
from nograd.schema.config import load_config
from nograd.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {
    "digits": ("onnx", "onnx-int8", "torch_export", "aoti"),
    "minilm": ("onnx", "onnx-int8", "torch_export"),
}
"""minilm's AOTInductor compile takes minutes on 2 cores; ``--aoti-minilm`` adds it."""
PASSES = 7


def _batches(handler: ModelHandler, tokens: bool) -> list[tuple[int, list[TensorPart]]]:
    generator = np.random.default_rng(5)

    def batch(rows: int) -> list[TensorPart]:
        if tokens:
            lengths = generator.integers(8, 49, size=rows)
            return [handler.example(1, int(n), seed=i) for i, n in enumerate(lengths)]
        return [handler.example(rows, seed=3)]

    return [(1, batch(1)), (32, batch(32))]


def measure(model: str, engines: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per engine: samples/s and ms at batch 1 and 32, and the accuracy against eager."""
    folder = ROOT / "models" / model
    config = load_config(folder / "config.toml", override={"channels_last": False})
    handler = build_handler(ROOT / "models", folder, config, torch.device("cpu"))
    assert isinstance(handler, ModelHandler), "a torch model's engines are measured"
    batches = _batches(handler, config.batch_unit == "tokens")
    runner = TorchRunner(handler)
    reference = [runner.run_batch(parts) for _, parts in batches]
    traced = export_program(handler)
    rows = [_row(model, "eager", time_parts(runner, batches, PASSES), None)]
    cache = Settings().engine_cache_dir
    for engine in engines:
        handler.speed_path = build_engine(engine, traced, handler, [folder / "model.py"], cache)
        outputs = [runner.run_batch(parts) for _, parts in batches]
        flat_ref = [out for result in reference for out in result]
        flat_out = [out for result in outputs for out in result]
        accuracy = compare(flat_ref, flat_out)
        rows.append(_row(model, engine, time_parts(runner, batches, PASSES), accuracy.summary()))
        handler.speed_path = None
    return rows


def _row(
    model: str, engine: str, seconds: tuple[float, ...], accuracy: str | None
) -> dict[str, Any]:
    one, thirty_two = seconds
    return {
        "model": model,
        "engine": engine,
        "batch1_per_s": 1 / one,
        "batch32_per_s": 32 / thirty_two,
        "batch1_ms": 1e3 * one,
        "batch32_ms": 1e3 * thirty_two,
        "accuracy": accuracy or "reference",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="one JSON list on stdout")
    parser.add_argument("--aoti-minilm", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for model, engines in ENGINES.items():
        if model == "minilm" and args.aoti_minilm:
            engines = (*engines, "aoti")
        rows += measure(model, engines)
    if args.json:
        print(json.dumps(rows))
        return
    for row in rows:
        print(
            f"| {row['model']} | {row['engine']} | {row['batch1_per_s']:,.0f} | "
            f"{row['batch32_per_s']:,.0f} | {row['batch1_ms']:.2f} | {row['batch32_ms']:.2f} | "
            f"{row['accuracy']} |"
        )


if __name__ == "__main__":
    main()
