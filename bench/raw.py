"""Baseline (a): the raw model, the same forward in a tight loop, no HTTP: the limit.

For each batch size, the forward (and minilm's mean pooling + L2 norm) runs under
``torch.inference_mode()`` for a fixed time on inputs prepared beforehand; the result is samples
per second, and the best over batch sizes is the limit a server on the same cores can approach.
For minilm the batches are the workload's own sentences, padded to each batch's longest, and a
second figure includes tokenisation (which a server must also do). The batch-1 latency (median
over the workload's sentences) is the reference for the concurrency-1 target. A third figure is
nograd's own forward of the same weights (``PackedEncoder``, padding skipped) on the same
batches: the limit for nograd's forward, which does less arithmetic than the padded model.

Batch sizes are measured in rounds (``--rounds``), the order reversed every other round, and each
keeps its best round: the machine's speed drifts within minutes here, and measured one after
another the batch sizes were ranked partly by when each ran (minilm's packed forward read fastest
at 8 rows in one run; interleaved, 8 rows ran 153 sentences/s against 187-196 at 32-128).

Run as ``python -m bench.raw --out FILE`` (in its own process, pinned like the server).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import orjson
import torch

from bench import workloads
from bench.models import Digits, MiniLM

DIGITS_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MINILM_BATCHES = (1, 2, 4, 8, 16, 32, 64)

ROUNDS = 3
T = TypeVar("T")
K = TypeVar("K")


def timed(step: Callable[[int], object], seconds: float, warmup: int = 3) -> tuple[int, float]:
    """Calls ``step(i)`` for about ``seconds``; returns (calls, elapsed)."""
    for i in range(warmup):
        step(i)
    calls = 0
    started = time.perf_counter()
    while True:
        step(calls)
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds and calls >= 3:
            return calls, elapsed


def cycling(fn: Callable[[T], object], items: Sequence[T]) -> Callable[[int], object]:
    """``timed``'s step over ``items`` in turn; bound now, so loop-made steps keep their own."""
    return lambda i: fn(items[i % len(items)])


def rate(
    step: Callable[[int], object], seconds: float, batch: int, warmup: int
) -> Callable[[], float]:
    """A measurement for :func:`interleaved`: samples per second of ``step`` over ``seconds``."""

    def measure() -> float:
        calls, elapsed = timed(step, seconds, warmup)
        return calls * batch / elapsed

    return measure


def interleaved(
    measures: Sequence[tuple[K, Callable[[], float]]], rounds: int
) -> dict[K, list[float]]:
    """Every measurement once per round, the order reversed every other round; each key's values
    in round order. A slow stretch of the machine then falls on every batch size alike."""
    values: dict[K, list[float]] = {key: [] for key, _ in measures}
    for index in range(max(1, rounds)):
        for key, measure in measures if index % 2 == 0 else measures[::-1]:
            values[key].append(measure())
    return values


def raw_digits(
    seconds: float, rounds: int, batches: Sequence[int] = DIGITS_BATCHES
) -> dict[str, Any]:
    model = Digits()
    images = torch.from_numpy(workloads.digits_images(4096))
    measures = []
    for batch in batches:
        chunks = [images[i : i + batch] for i in range(0, len(images) - batch + 1, batch)]
        measures.append((batch, rate(cycling(model.forward, chunks), seconds, batch, warmup=3)))
    with torch.inference_mode():
        values = interleaved(measures, rounds)
    rows: list[dict[str, Any]] = [
        {
            "batch": batch,
            "samples_per_s": max(values[batch]),
            "ms_per_batch": 1e3 * batch / max(values[batch]),
            "rounds": values[batch],
        }
        for batch in batches
    ]
    best = max(rows, key=lambda r: r["samples_per_s"])
    return {"model": "digits", "rows": rows, "best": best}


MINILM_KINDS = ("samples_per_s", "samples_per_s_with_tokenize", "packed_samples_per_s")
"""transformers' BertModel on padded batches; the same with tokenisation; nograd's PackedEncoder
(padding skipped) on the same batches."""


def raw_minilm(
    seconds: float, rounds: int, batches: Sequence[int] = MINILM_BATCHES, batch1: bool = True
) -> dict[str, Any]:
    model = MiniLM()
    texts = workloads.sentences(512)
    measures: list[tuple[tuple[int, str], Callable[[], float]]] = []
    for batch in batches:
        groups = [texts[i : i + batch] for i in range(0, len(texts) - batch + 1, batch)]
        tokens = [model.tokenize(g) for g in groups]
        measures += [
            ((batch, "samples_per_s"), rate(cycling(model.forward, tokens), seconds, batch, 2)),
            (
                (batch, "samples_per_s_with_tokenize"),
                rate(cycling(model.embed, groups), seconds / 2, batch, 1),
            ),
            (
                (batch, "packed_samples_per_s"),
                rate(cycling(model.forward_packed, tokens), seconds, batch, 2),
            ),
        ]
    with torch.inference_mode():
        values = interleaved(measures, rounds)
        single = batch1_inputs(model, texts) if batch1 else []
        batch1_figures = batch1_summary(batch1_latencies(model.forward, single)) if batch1 else {}
        packed_latencies = batch1_latencies(model.forward_packed, single) if batch1 else []
    rows = []
    for batch in batches:
        row: dict[str, Any] = {"batch": batch}
        row |= {kind: max(values[(batch, kind)]) for kind in MINILM_KINDS}
        row["ms_per_batch"] = 1e3 * batch / row["samples_per_s"]
        row["rounds"] = {kind: values[(batch, kind)] for kind in MINILM_KINDS}
        rows.append(row)
    best = max(rows, key=lambda r: r["samples_per_s"])
    packed_best = max(rows, key=lambda r: r["packed_samples_per_s"])
    out = {
        "model": "minilm",
        "rows": rows,
        "best": best,
        **batch1_figures,
        "packed_best": {
            "batch": packed_best["batch"],
            "samples_per_s": packed_best["packed_samples_per_s"],
        },
    }
    if packed_latencies:
        out["packed_batch1_p50_ms"] = 1e3 * float(np.median(packed_latencies))
    return out


def batch1_inputs(model: MiniLM, texts: Sequence[str]) -> list[dict[str, torch.Tensor]]:
    """One tokenised text per forward: the workload's first 128 sentences, which are the first
    of the bodies minilm-1's load sends."""
    return [model.tokenize([t]) for t in texts[:128]]


def batch1_summary(latencies: Sequence[float]) -> dict[str, float]:
    return {
        "batch1_p50_ms": 1e3 * float(np.median(latencies)),
        "batch1_mean_ms": 1e3 * float(np.mean(latencies)),
    }


def minilm_batch1() -> dict[str, float]:
    """Only the batch-1 forward over the workload's sentences: run beside a concurrency-1 load,
    so the target compares the served p50 with the forward at the machine's speed of that
    minute, which moves by 15 % and more between a run's phases here."""
    model = MiniLM()
    with torch.inference_mode():
        return batch1_summary(
            batch1_latencies(model.forward, batch1_inputs(model, workloads.sentences(128)))
        )


def batch1_latencies(
    forward: Callable[[dict[str, torch.Tensor]], object], single: list[dict[str, torch.Tensor]]
) -> list[float]:
    """Seconds per batch-1 forward over ``single``, after a few warm-up calls."""
    for tokens in single[:5]:
        forward(tokens)
    latencies = []
    for tokens in single:
        started = time.perf_counter()
        forward(tokens)
        latencies.append(time.perf_counter() - started)
    return latencies


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=1.0, help="per batch size and round")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds")
    parser.add_argument("--models", default="digits,minilm")
    parser.add_argument(
        "--batches", default=None, help="comma-separated batch sizes (default: every size)"
    )
    parser.add_argument(
        "--batch1", action="store_true", help="only minilm's batch-1 forward latencies"
    )
    parser.add_argument(
        "--skip-batch1", action="store_true", help="no batch-1 latencies after the batch sizes"
    )
    args = parser.parse_args(argv)
    chosen = tuple(int(b) for b in args.batches.split(",")) if args.batches else None
    result: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "rounds": args.rounds}
    if args.batch1:
        result["minilm"] = minilm_batch1()
    else:
        for name in args.models.split(","):
            if name == "digits":
                result[name] = raw_digits(args.seconds, args.rounds, chosen or DIGITS_BATCHES)
            else:
                result[name] = raw_minilm(
                    args.seconds, args.rounds, chosen or MINILM_BATCHES, not args.skip_batch1
                )
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
