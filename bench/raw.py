"""Baseline (a): the raw model, the same forward in a tight loop, no HTTP: the limit.

For each batch size, the forward (and minilm's mean pooling + L2 norm) runs under
``torch.inference_mode()`` for a fixed time on inputs prepared beforehand; the result is samples
per second, and the best over batch sizes is the limit a server on the same cores can approach.
For minilm the batches are the workload's own sentences, padded to each batch's longest, and a
second figure includes tokenisation (which a server must also do). The batch-1 latency (median
over the workload's sentences) is the reference for the concurrency-1 target. A third figure is
nograd's own forward of the same weights (``PackedEncoder``, padding skipped) on the same
batches: the limit for nograd's forward, which does less arithmetic than the padded model.

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

T = TypeVar("T")


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


def raw_digits(seconds: float) -> dict[str, Any]:
    model = Digits()
    images = torch.from_numpy(workloads.digits_images(4096))
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for batch in DIGITS_BATCHES:
            chunks = [images[i : i + batch] for i in range(0, len(images) - batch + 1, batch)]
            calls, elapsed = timed(cycling(model.forward, chunks), seconds)
            rows.append(
                {
                    "batch": batch,
                    "samples_per_s": calls * batch / elapsed,
                    "ms_per_batch": 1e3 * elapsed / calls,
                }
            )
    best = max(rows, key=lambda r: r["samples_per_s"])
    return {"model": "digits", "rows": rows, "best": best}


def raw_minilm(seconds: float) -> dict[str, Any]:
    model = MiniLM()
    texts = workloads.sentences(512)
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for batch in MINILM_BATCHES:
            groups = [texts[i : i + batch] for i in range(0, len(texts) - batch + 1, batch)]
            tokens = [model.tokenize(g) for g in groups]
            calls, elapsed = timed(cycling(model.forward, tokens), seconds, warmup=2)
            calls_tok, elapsed_tok = timed(cycling(model.embed, groups), seconds / 2, warmup=1)
            calls_packed, elapsed_packed = timed(
                cycling(model.forward_packed, tokens), seconds, warmup=2
            )
            rows.append(
                {
                    "batch": batch,
                    "samples_per_s": calls * batch / elapsed,
                    "samples_per_s_with_tokenize": calls_tok * batch / elapsed_tok,
                    "ms_per_batch": 1e3 * elapsed / calls,
                    "packed_samples_per_s": calls_packed * batch / elapsed_packed,
                }
            )
        single = batch1_inputs(model, texts)
        batch1 = batch1_summary(batch1_latencies(model.forward, single))
        packed_latencies = batch1_latencies(model.forward_packed, single)
    best = max(rows, key=lambda r: r["samples_per_s"])
    packed_best = max(rows, key=lambda r: r["packed_samples_per_s"])
    return {
        "model": "minilm",
        "rows": rows,
        "best": best,
        **batch1,
        "packed_best": {
            "batch": packed_best["batch"],
            "samples_per_s": packed_best["packed_samples_per_s"],
        },
        "packed_batch1_p50_ms": 1e3 * float(np.median(packed_latencies)),
    }


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
    parser.add_argument("--seconds", type=float, default=1.0, help="per batch size")
    parser.add_argument("--models", default="digits,minilm")
    parser.add_argument(
        "--batch1", action="store_true", help="only minilm's batch-1 forward latencies"
    )
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    if args.batch1:
        result["minilm"] = minilm_batch1()
    else:
        for name in args.models.split(","):
            result[name] = (
                raw_digits(args.seconds) if name == "digits" else raw_minilm(args.seconds)
            )
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
