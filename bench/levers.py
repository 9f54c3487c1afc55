"""Speed levers on this CPU, for both models (issue 5, "Measure and report").

* autograd mode: ``torch.inference_mode()`` vs ``torch.no_grad()`` vs grad enabled (a fresh model
  whose parameters require grad, called with no context manager, as a naive server would);
* precision: bf16 (weights cast, as nograd's ``precision = "bf16"`` does; and CPU autocast) vs
  fp32, with the accuracy delta against fp32 on held-out inputs: max abs error and min cosine
  similarity of the outputs (digits logits, minilm embeddings);
* ``torch.compile`` (inductor) vs eager: compile time (first call) and throughput at fixed shapes.
  It runs last and in its own process with a time limit; a failure is reported with its reason.

Throughput is samples/s of the raw forward at batch 1 and at a large batch, inputs prepared
beforehand. Run as ``python -m bench.levers --out FILE [--compile] [--seconds S]``.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import orjson
import torch

from bench import workloads
from bench.models import Digits, MiniLM
from bench.raw import timed

DIGITS_BIG = 64
MINILM_BIG = 32
FIXED_LENGTH = 48
"""minilm inputs padded to a fixed length here, so compile and eager see the same shapes."""

T = TypeVar("T")


def bind(fn: Callable[[T], object], arg: T) -> Callable[[], object]:
    """``fn(arg)`` as a no-argument step; bound now, so loop-made steps keep their own input."""
    return lambda: fn(arg)


def throughput(step: Callable[[], object], batch: int, seconds: float) -> float:
    calls, elapsed = timed(lambda _i: step(), seconds)
    return calls * batch / elapsed


@contextlib.contextmanager
def grad_enabled() -> Iterator[None]:
    with torch.enable_grad():
        yield


MODES: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "grad_enabled": grad_enabled,
}


def digits_inputs(batch: int) -> torch.Tensor:
    return torch.from_numpy(workloads.digits_images(batch, seed=workloads.SEED + batch))


def minilm_tokens(model: MiniLM, batch: int, fixed: bool = False) -> dict[str, torch.Tensor]:
    texts = workloads.sentences(batch, seed=workloads.SEED + batch)
    if not fixed:
        return model.tokenize(texts)
    tokens = model.tokenize(texts)
    length = tokens["input_ids"].shape[1]
    pad = FIXED_LENGTH - length
    return {
        name: torch.nn.functional.pad(t[:, :FIXED_LENGTH], (0, max(pad, 0)))
        for name, t in tokens.items()
    }


def cosine_stats(reference: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    reference = reference.float()
    other = other.float()
    cosine = torch.nn.functional.cosine_similarity(reference, other, dim=1)
    return {
        "max_abs_error": float((reference - other).abs().max()),
        "min_cosine": float(cosine.min()),
        "mean_cosine": float(cosine.mean()),
    }


def grad_modes(seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    digits = Digits()
    minilm = MiniLM()
    for name, model, batches in (
        ("digits", digits, (1, DIGITS_BIG)),
        ("minilm", minilm, (1, MINILM_BIG)),
    ):
        rows = []
        params = list(
            model.module.parameters() if isinstance(model, Digits) else model.bert.parameters()
        )
        for batch in batches:
            if name == "digits":
                x = digits_inputs(batch)
                step = bind(digits.forward, x)
            else:
                tokens = minilm_tokens(minilm, batch)
                step = bind(minilm.forward, tokens)
            row: dict[str, Any] = {"batch": batch}
            for mode, factory in MODES.items():
                # Grad enabled only costs anything when parameters require grad, as a fresh
                # model's do; the served model has them off.
                for p in params:
                    p.requires_grad_(mode == "grad_enabled")
                with factory():
                    row[mode] = throughput(step, batch, seconds)
            for p in params:
                p.requires_grad_(False)
            rows.append(row)
        out[name] = rows
    return out


def _rates(
    step: Callable[[object], object], inputs: dict[int, Any], seconds: float
) -> dict[str, float]:
    """samples/s per batch size, keyed ``batch<N>``."""
    return {f"batch{b}": throughput(bind(step, x), b, seconds) for b, x in inputs.items()}


def precision(seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # digits: logits of 512 held-out images.
    digits = Digits()
    held_out = torch.from_numpy(workloads.digits_images(512, seed=7))
    images = {b: digits_inputs(b) for b in (1, DIGITS_BIG)}

    def digits_step(x: object) -> object:
        assert isinstance(x, torch.Tensor)
        return digits.forward(x)

    with torch.inference_mode():
        reference = digits.forward(held_out)["logits"]
        fp32 = _rates(digits_step, images, seconds)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast_out = digits.forward(held_out)["logits"]
            autocast_tp = _rates(digits_step, images, seconds)
        digits.module.to(torch.bfloat16)
        cast_out = digits.forward(held_out.to(torch.bfloat16))["logits"]
        cast_images = {b: x.to(torch.bfloat16) for b, x in images.items()}
        cast_tp = _rates(digits_step, cast_images, seconds)
    out["digits"] = {
        "fp32": fp32,
        "bf16_cast": {**cast_tp, **cosine_stats(reference, cast_out)},
        "bf16_autocast": {**autocast_tp, **cosine_stats(reference, autocast_out)},
        "label_agreement_bf16_cast": float(
            (reference.argmax(1) == cast_out.float().argmax(1)).float().mean()
        ),
        "label_agreement_bf16_autocast": float(
            (reference.argmax(1) == autocast_out.float().argmax(1)).float().mean()
        ),
    }
    # minilm: embeddings of 256 held-out sentences.
    minilm = MiniLM()
    texts = workloads.sentences(256, seed=11)

    def embed_all() -> torch.Tensor:
        return torch.cat([minilm.embed(texts[i : i + 32])["embedding"] for i in range(0, 256, 32)])

    def minilm_step(tokens: object) -> object:
        assert isinstance(tokens, dict)
        return minilm.forward(tokens)

    with torch.inference_mode():
        ref = embed_all()
        batches = {b: minilm_tokens(minilm, b) for b in (1, MINILM_BIG)}
        fp32 = _rates(minilm_step, batches, seconds)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = embed_all()
            auto_tp = _rates(minilm_step, batches, seconds)
        minilm.bert.to(torch.bfloat16)
        cast = embed_all()
        cast_tp = _rates(minilm_step, batches, seconds)
    out["minilm"] = {
        "fp32": fp32,
        "bf16_cast": {**cast_tp, **cosine_stats(ref, cast)},
        "bf16_autocast": {**auto_tp, **cosine_stats(ref, auto)},
    }
    return out


def thread_counts(seconds: float) -> dict[str, Any]:
    """samples/s with 1 and 2 intra-op threads, alone and beside one busy process.

    The busy process stands for whatever else wants a core: on a server, its own event loop.
    It is a bounded child (killed in ``finally``) that spins for at most two minutes.
    """
    import subprocess
    import sys

    digits = Digits()
    minilm = MiniLM()
    cases: list[tuple[str, int, Callable[[], object]]] = []
    for batch in (1, DIGITS_BIG):
        x = digits_inputs(batch)
        cases.append(("digits", batch, bind(digits.forward, x)))
    for batch in (1, MINILM_BIG):
        tokens = minilm_tokens(minilm, batch)
        cases.append(("minilm", batch, bind(minilm.forward, tokens)))
    spin = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end: pass\n"
    original = torch.get_num_threads()
    rows = []
    try:
        with torch.inference_mode():
            for busy in (False, True):
                hog = subprocess.Popen([sys.executable, "-c", spin]) if busy else None
                try:
                    for threads in (1, 2):
                        torch.set_num_threads(threads)
                        for model, batch, step in cases:
                            rows.append(
                                {
                                    "model": model,
                                    "batch": batch,
                                    "threads": threads,
                                    "busy_neighbour": busy,
                                    "samples_per_s": throughput(step, batch, seconds),
                                }
                            )
                finally:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
    finally:
        torch.set_num_threads(original)
    return {"rows": rows}


def compile_vs_eager(seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("digits", "minilm"):
        try:
            out[name] = _compile_one(name, seconds)
        except Exception as exc:  # the lever is optional: report why it failed and go on
            out[name] = {
                "error": f"{type(exc).__name__}: {exc}"[:500],
                "trace": traceback.format_exc(limit=3)[-1500:],
            }
    return out


def _compile_one(name: str, seconds: float) -> dict[str, Any]:
    torch._dynamo.reset()
    if name == "digits":
        digits = Digits()
        compiled = torch.compile(digits.module, dynamic=False)
        batches: tuple[int, ...] = (1, DIGITS_BIG)
        images = {b: digits_inputs(b) for b in batches}

        def eager(b: int) -> object:
            return digits.module(images[b])

        def fast(b: int) -> object:
            return compiled(images[b])

    else:
        minilm = MiniLM()
        pool = minilm._pool

        def run_bert(module: Callable[..., Any], tokens: dict[str, torch.Tensor]) -> object:
            hidden = module(**tokens).last_hidden_state
            return pool(hidden, tokens["attention_mask"])

        compiled_bert = torch.compile(minilm.bert, dynamic=False)
        batches = (1, MINILM_BIG)
        batch_tokens = {b: minilm_tokens(minilm, b, fixed=True) for b in batches}

        def eager(b: int) -> object:
            return run_bert(minilm.bert, batch_tokens[b])

        def fast(b: int) -> object:
            return run_bert(compiled_bert, batch_tokens[b])

    result: dict[str, Any] = {"shapes": "fixed" if name == "digits" else f"length {FIXED_LENGTH}"}
    with torch.inference_mode():
        for b in batches:
            started = time.perf_counter()
            compiled_out = fast(b)
            result[f"compile_s_batch{b}"] = time.perf_counter() - started
            eager_out = eager(b)
            if isinstance(eager_out, dict):
                eager_out, compiled_out = eager_out["logits"], compiled_out["logits"]  # type: ignore[index]
            assert isinstance(eager_out, torch.Tensor) and isinstance(compiled_out, torch.Tensor)
            result[f"max_abs_error_batch{b}"] = float((eager_out - compiled_out).abs().max())
            result[f"eager_batch{b}"] = throughput(bind(eager, b), b, seconds)
            result[f"compiled_batch{b}"] = throughput(bind(fast, b), b, seconds)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--only", choices=("modes", "compile"), default="modes")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    if args.only == "modes":
        result["grad_modes"] = grad_modes(args.seconds)
        result["precision"] = precision(args.seconds)
        result["threads"] = thread_counts(args.seconds)
    else:
        result["compile"] = compile_vs_eager(args.seconds)
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
