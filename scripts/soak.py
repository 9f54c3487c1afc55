"""Soak test: steady load on a real nograd for a fixed time; resident memory must stay flat.

Starts the server on the shipped models, drives a bounded closed-loop load (digits and minilm
mixed) from this process, samples the server's resident set every few seconds, and reports
errors and memory growth after warmup. Exit status 1 when growth >= 5% or any request failed.

    python scripts/soak.py --minutes 10 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.serving import run_server  # noqa: E402

WORDS = [
    "the",
    "model",
    "server",
    "batches",
    "requests",
    "into",
    "one",
    "forward",
    "pass",
    "and",
    "answers",
    "each",
    "caller",
    "with",
    "its",
    "own",
    "rows",
    "while",
    "memory",
    "stays",
    "flat",
    "under",
    "steady",
    "load",
    "for",
    "minutes",
    "on",
    "end",
]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def digits_body(rng: random.Random) -> dict[str, object]:
    data = [float(rng.randint(0, 16)) for _ in range(64)]
    return {"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": data}]}


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 30)))


async def drive(url: str, seconds: float, concurrency: int, pid: int) -> dict[str, object]:
    counts = {"ok": 0, "errors": 0}
    error_samples: list[str] = []
    samples: list[tuple[float, int]] = []
    started = time.monotonic()
    stop_at = started + seconds

    async def worker(index: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(index)
        while time.monotonic() < stop_at:
            try:
                if rng.random() < 0.7:
                    response = await client.post("/v2/models/digits/infer", json=digits_body(rng))
                else:
                    body = {"model": "minilm", "input": sentence(rng)}
                    response = await client.post("/v1/embeddings", json=body)
                if response.status_code == 200:
                    counts["ok"] += 1
                else:
                    counts["errors"] += 1
                    error_samples.append(f"{response.status_code}: {response.text[:200]}")
            except httpx.HTTPError as exc:
                counts["errors"] += 1
                error_samples.append(repr(exc))

    async def sampler() -> None:
        while time.monotonic() < stop_at:
            samples.append((time.monotonic() - started, rss_bytes(pid)))
            done = (time.monotonic() - started) / seconds
            print(
                f"\r{done:6.1%}  ok={counts['ok']}  errors={counts['errors']}  "
                f"rss={samples[-1][1] / 2**20:.1f} MiB",
                end="",
                file=sys.stderr,
                flush=True,
            )
            await asyncio.sleep(5)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        await asyncio.gather(sampler(), *(worker(i, client) for i in range(concurrency)))
    print(file=sys.stderr)
    warm = [rss for t, rss in samples if t >= min(60.0, seconds / 5)]
    head = warm[: max(1, len(warm) // 10)]
    tail = warm[-max(1, len(warm) // 10) :]
    baseline = sum(head) / len(head)
    growth = (sum(tail) / len(tail) - baseline) / baseline
    return {
        "seconds": round(time.monotonic() - started, 1),
        "concurrency": concurrency,
        "requests_ok": counts["ok"],
        "errors": counts["errors"],
        "error_samples": error_samples[:5],
        "throughput_rps": round(counts["ok"] / seconds, 1),
        "rss_after_warmup_mib": round(baseline / 2**20, 1),
        "rss_end_mib": round(sum(tail) / len(tail) / 2**20, 1),
        "rss_max_mib": round(max(rss for _, rss in samples) / 2**20, 1),
        "rss_growth_after_warmup": round(growth, 4),
        "samples": [(round(t, 1), rss) for t, rss in samples],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs, run_server(Path(logs)) as server:
        result = asyncio.run(
            drive(server.url, args.minutes * 60, args.concurrency, server.process.pid)
        )
    result["cores"] = os.cpu_count()
    result["client_cpu_seconds"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_utime, 1)
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2))
    growth = result["rss_growth_after_warmup"]
    assert isinstance(growth, float)
    return 0 if result["errors"] == 0 and growth < 0.05 else 1


if __name__ == "__main__":
    raise SystemExit(main())
