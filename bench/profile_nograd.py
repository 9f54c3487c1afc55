"""Where nograd's time goes: py-spy on the live server under load, torch.profiler on its batch path.

* ``pyspy_categories``: reads ``py-spy record --format raw --threads`` output (collapsed stacks
  sampled from the running ``nograd`` process while wrk drives it) and charges every sample to
  the first frame, from the leaf up, that matches a category below: CPU time per request in µs
  and the share of all sampled Python-thread CPU. Native-only threads (torch's intra-op pool)
  are invisible to py-spy; the server's whole-process CPU is reported beside the samples.
* ``python -m bench.profile_nograd torch --out FILE``: builds each model's handler through
  nograd's own loader and runs its batch path (collate → forward → to_numpy → split) under
  ``torch.profiler`` at a given batch size: ms per phase and the top operators; plus
  micro-timings of nograd's V2 codec (decode one body, encode one answer) and of minilm's
  ``prepare`` (tokenisation), in µs per request.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

# (category, substrings of a py-spy frame "function (file:line)"); first match from the leaf wins.
IDLE = "waiting (idle thread py-spy counted)"
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Blocking waits py-spy's idle detection can miss (an executor thread parked on its queue).
    (IDLE, ("_worker (concurrent/futures/thread.py:8", "wait (threading.py")),
    ("tokenisation", ("tokenizers", "prepare (model.py", "_utf8 (model.py")),
    (
        "forward (torch ops)",
        (
            "(torch/",
            "(transformers/",
            "forward (model.py",
            "Handler.forward",
            "mean_pool_normalise",
        ),
    ),
    ("collate / to_numpy / split", ("collate (", "_pad_concat", "to_numpy", "split_rows")),
    ("JSON encode (V2 answer)", ("encode_outputs", "encode_tensor", "dumps (nograd/", "join_body")),
    (
        "JSON decode + validation",
        (
            "(nograd/protocol/v2.py",
            "(nograd/protocol/binary.py",
            "validate (nograd/",
            "(nograd/core/datatypes.py",
        ),
    ),
    (
        "metrics (prometheus)",
        ("prometheus_client", "(nograd/observability/metrics.py", "(nograd/observability/stats.py"),
    ),
    ("batcher", ("(nograd/batching/",)),
    ("nograd middleware", ("(nograd/http/middleware.py",)),
    ("nograd routes / data plane", ("(nograd/",)),
    ("FastAPI telemetry check (opentelemetry)", ("(fastapi/telemetry/", "(opentelemetry/")),
    ("FastAPI routing / dependencies", ("(fastapi/",)),
    ("Starlette (request, response, middleware)", ("(starlette/", "(anyio/")),
    ("uvicorn HTTP protocol (httptools)", ("(uvicorn/", "(h11/", "(httptools/")),
    ("thread hand-off", ("(concurrent/futures/", "(threading.py", "(queue.py")),
    ("event loop (uvloop C code: epoll, sockets)", ("Runner.run", "(asyncio/", "uvloop")),
)


def categorize_frames(frames: list[str]) -> str:
    for frame in reversed(frames):
        for category, needles in CATEGORIES:
            if any(needle in frame for needle in needles):
                return category
    return "other"


def pyspy_categories(raw: Path, rate_hz: int, requests: int) -> dict[str, Any]:
    """Aggregate collapsed stacks into categories, threads and top self frames.

    Shares are of the busy samples: samples charged to :data:`IDLE` (threads parked on a queue
    that py-spy still counted) are reported apart. ``thread_us_per_request`` is busy samples
    over the sampling rate per request: thread time, which on a contended machine includes time
    a runnable thread waited for a core.
    """
    by_category: Counter[str] = Counter()
    by_thread: Counter[str] = Counter()
    by_leaf: Counter[str] = Counter()
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        body = frames[1:]
        category = categorize_frames(body)
        by_category[category] += count
        if category == IDLE:
            continue
        thread = frames[0]
        name = thread.split(":", 1)[1].strip() if ":" in thread else thread
        by_thread[name.rstrip("_0123456789") or name] += count
        if body:
            by_leaf[body[-1]] += count
    idle = by_category.pop(IDLE, 0)
    busy = sum(by_category.values())
    per_request = 1e6 / rate_hz / max(requests, 1)

    def table(counter: Counter[str], limit: int) -> list[dict[str, Any]]:
        return [
            {
                "name": name,
                "samples": n,
                "share": n / busy if busy else 0.0,
                "thread_us_per_request": n * per_request,
            }
            for name, n in counter.most_common(limit)
        ]

    return {
        "samples": busy,
        "idle_samples": idle,
        "rate_hz": rate_hz,
        "requests": requests,
        "sampled_thread_s": busy / rate_hz,
        "thread_us_per_request": busy * per_request,
        "categories": table(by_category, 20),
        "threads": table(by_thread, 10),
        "top_frames": table(by_leaf, 15),
    }


# ------------------------------------------------------------------------------- torch.profiler
def _time_us(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(min(20, repeat)):
        fn()
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeat):
            fn()
        samples.append((time.perf_counter() - started) / repeat)
    return 1e6 * statistics.median(samples)


def torch_profile(digits_batch: int, minilm_batch: int) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    for name, batch, workload in (
        ("digits", digits_batch, "digits"),
        ("minilm", minilm_batch, "minilm-1"),
    ):
        out[name] = _profile_model(name, batch, workload)
    return out


def _profile_model(name: str, batch: int, workload: str) -> dict[str, Any]:
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from bench import workloads
    from bench.common import ROOT
    from nograd.runtime.handler import ModelHandler, split_rows
    from nograd.runtime.loader import build_handler
    from nograd.schema.config import find_config, load_config

    repository = ROOT / "models"
    path = find_config(repository / name)
    assert path is not None
    handler = build_handler(repository, repository / name, load_config(path), torch.device("cpu"))
    assert isinstance(handler, ModelHandler), "profiled through collate, forward and to_numpy"
    bodies = workloads.make(workload, count=max(batch, 64)).bodies
    entry: dict[str, Any] = {"batch": batch}
    # nograd's codec on one request body and one answer, in µs (run on one thread here).
    decoded: list[Any] = []
    try:
        from nograd.protocol.v2 import decode_body

        decoded = [decode_body(body, None) for body in bodies[:batch]]
        entry["v2_decode_us"] = _time_us(lambda: decode_body(bodies[0], None), 300)
    except Exception as exc:  # the codec's API moves; report rather than fail the bench
        entry["v2_codec_error"] = f"{type(exc).__name__}: {exc}"
    if name == "minilm":
        texts = [orjson.loads(b)["inputs"][0]["data"][0] for b in bodies[:batch]]
        inputs = [{"text": np.array([t.encode()], dtype=object)} for t in texts]
    elif decoded:
        inputs = [{"image": d.inputs["image"]} for d in decoded]
    else:
        inputs = [{"image": workloads.digits_images(1)} for _ in range(batch)]
    parts = [handler.prepare(x) for x in inputs]
    entry["prepare_us"] = _time_us(lambda: handler.prepare(inputs[0]), 200)

    def run_once() -> list[dict[str, Any]]:
        with record_function("collate"):
            tensors = handler.collate(parts)
        with record_function("forward"):
            outputs = handler.forward(tensors)
        with record_function("to_numpy"):
            arrays = handler.to_numpy(outputs)
        with record_function("split_rows"):
            return split_rows(arrays, [p.rows for p in parts])

    with torch.inference_mode():
        for _ in range(5):
            results = run_once()
        phases: dict[str, list[float]] = {"collate": [], "forward": [], "to_numpy": []}
        for _ in range(20 if name == "minilm" else 200):
            t0 = time.perf_counter()
            tensors = handler.collate(parts)
            t1 = time.perf_counter()
            outputs = handler.forward(tensors)
            t2 = time.perf_counter()
            handler.to_numpy(outputs)
            t3 = time.perf_counter()
            phases["collate"].append(t1 - t0)
            phases["forward"].append(t2 - t1)
            phases["to_numpy"].append(t3 - t2)
        entry["phase_ms"] = {k: 1e3 * statistics.median(v) for k, v in phases.items()}
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5 if name == "minilm" else 50):
                run_once()
    events = prof.key_averages()
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    total_self = sum(e.self_cpu_time_total for e in events) or 1.0
    entry["top_ops"] = [
        {"op": e.key, "self_cpu_share": e.self_cpu_time_total / total_self, "calls": e.count}
        for e in top[:10]
    ]
    if decoded:
        try:
            from nograd.protocol.v2 import dumps, encode_outputs, select_outputs

            answer = results[0]
            selected = select_outputs(list(answer), decoded[0].outputs, decoded[0].parameters)

            def encode() -> bytes:
                tensors_, _chunks = encode_outputs(answer, selected)
                document = {"model_name": name, "model_version": "1", "outputs": tensors_}
                return bytes(dumps(document))

            entry["v2_encode_us"] = _time_us(encode, 300)
        except Exception as exc:
            entry["v2_encode_error"] = f"{type(exc).__name__}: {exc}"
    return entry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    torch_cmd = sub.add_parser("torch")
    torch_cmd.add_argument("--out", type=Path, required=True)
    torch_cmd.add_argument("--digits-batch", type=int, default=16)
    torch_cmd.add_argument("--minilm-batch", type=int, default=8)
    spy = sub.add_parser("pyspy", help="summarise a raw py-spy file")
    spy.add_argument("raw", type=Path)
    spy.add_argument("--rate", type=int, default=100)
    spy.add_argument("--requests", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "torch":
        result = torch_profile(args.digits_batch, args.minilm_batch)
        args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    else:
        summary = pyspy_categories(args.raw, args.rate, args.requests)
        print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
