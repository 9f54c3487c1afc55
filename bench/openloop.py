"""Open-loop load: requests leave at a fixed arrival rate whatever the server does.

wrk keeps a fixed number of requests in flight (closed loop), so a slow server slows the load and
its queueing never shows; Debian has no wrk2. This generator schedules request *i* at
``t0 + arrival_i`` (Poisson arrivals with a fixed seed, or evenly spaced) and measures each
latency from its scheduled send time, so time spent waiting for a free connection or in the
server's queue counts (no coordinated omission).

It runs in its own process (``python -m bench.openloop``), ideally pinned to a core the server
does not use, and reports its own CPU share (user + system CPU seconds / wall seconds) and how far
behind schedule it fell, so a saturated generator is visible rather than silently lowering the
rate. Bounded: it stops issuing after ``--duration`` and gives every request ``--timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import sys
import time
from pathlib import Path
from types import ModuleType

import aiohttp
import numpy as np
import orjson

uvloop: ModuleType | None
try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
    uvloop = None


def arrivals(rate: float, duration: float, seed: int, poisson: bool) -> np.ndarray:
    """Send offsets in seconds from the start, all below ``duration``."""
    count = int(rate * duration)
    if not poisson:
        return np.arange(count, dtype=np.float64) / rate
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=int(count * 1.2) + 16)
    times = np.cumsum(gaps) - gaps[0]
    kept: np.ndarray = times[times < duration]
    return kept


async def drive(
    url: str,
    bodies: list[bytes],
    offsets: np.ndarray,
    timeout_s: float,
    max_connections: int,
) -> dict[str, object]:
    latencies = np.full(len(offsets), np.nan)
    statuses = np.zeros(len(offsets), dtype=np.int32)
    lags: list[float] = []
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=max_connections, force_close=False)
    client_timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:

        async def send(i: int, scheduled: float) -> None:
            try:
                async with session.post(url, data=bodies[i % len(bodies)], headers=headers) as r:
                    await r.read()
                    statuses[i] = r.status
            except TimeoutError:
                statuses[i] = -1
            except aiohttp.ClientError:
                statuses[i] = -2
            latencies[i] = time.perf_counter() - scheduled

        tasks: set[asyncio.Task[None]] = set()
        start = time.perf_counter() + 0.05
        for i, offset in enumerate(offsets):
            scheduled = start + float(offset)
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                lags.append(-delay)
            task = asyncio.create_task(send(i, scheduled))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        issued_s = time.perf_counter() - start
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s + 1.0)
        for task in list(tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        wall_s = time.perf_counter() - start

    ok = statuses == 200
    done = latencies[ok] * 1e6
    lag = np.asarray(lags) if lags else np.zeros(1)

    def pct(q: float) -> float:
        return float(np.percentile(done, q)) if done.size else float("nan")

    return {
        "requests": int(ok.sum()),
        "issued": len(offsets),
        "duration_us": int(issued_s * 1e6),
        "wall_s": wall_s,
        "errors_status": int(((statuses >= 300) | ((statuses > 0) & (statuses < 200))).sum()),
        "errors_timeout": int((statuses == -1).sum() + (statuses == 0).sum()),
        "errors_connect": int((statuses == -2).sum()),
        "latency_mean_us": float(done.mean()) if done.size else float("nan"),
        "latency_max_us": float(done.max()) if done.size else float("nan"),
        "p50_us": pct(50),
        "p90_us": pct(90),
        "p99_us": pct(99),
        "p999_us": pct(99.9),
        "late_sends": len(lags),
        "late_p99_ms": float(np.percentile(lag, 99) * 1e3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--bodies", type=Path, required=True, help="one JSON body per line")
    parser.add_argument("--rate", type=float, required=True, help="requests per second")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--max-connections", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--uniform", action="store_true", help="evenly spaced, not Poisson")
    args = parser.parse_args(argv)

    bodies = [line for line in args.bodies.read_bytes().splitlines() if line]
    offsets = arrivals(args.rate, args.duration, args.seed, poisson=not args.uniform)
    before = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter()
    if uvloop is not None:
        uvloop.install()
    result = asyncio.run(drive(args.url, bodies, offsets, args.timeout, args.max_connections))
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result.update(
        {
            "mode": "open",
            "rate": args.rate,
            "arrivals": "uniform" if args.uniform else "poisson",
            "generator_cpu_share": cpu / wall if wall > 0 else float("nan"),
        }
    )
    sys.stdout.write("OPENLOOP_JSON " + orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    main()
