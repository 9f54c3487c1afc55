"""An open-loop load generator in a process of its own: requests leave on a fixed schedule,
whatever the answers, as independent clients send them, and each is timed from its scheduled
moment (a late send counts against the server, never hides its backlog).

It runs apart from the test process and speaks raw HTTP/1.1 over plain asyncio protocols, keeping
a pool of keep-alive connections that grows when every one is busy: a generator on an httpx client
in the test's own process spent about a core at a few hundred requests a second, which on a
2-core machine starved the server it measured. It reports the CPU it used itself, so a run can
show that it did not.

    python -m tests.e2e.open_loop URL PATH BODY_FILE RATE_PER_S DURATION_S
        writes one JSON document to stdout: {"cpu_s", "wall_s", "outcomes": [[sent_at, status,
        seconds, retry_after], ...]} (status 0: no answer; retry_after null when absent)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    sent_at: float
    """Seconds from the run's start to this request's scheduled moment."""
    status: int
    """0 when no answer came (connection refused or cut, or the run's grace ran out)."""
    seconds: float
    """From the scheduled moment to the whole answer."""
    retry_after: str | None


@dataclass
class Run:
    outcomes: list[Outcome]
    cpu_s: float
    """CPU seconds the generator itself used (user and system)."""
    wall_s: float

    def statuses(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for outcome in self.outcomes:
            counts[outcome.status] = counts.get(outcome.status, 0) + 1
        return counts


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def _child(url: str, path: str, body: bytes, *args: str, timeout_s: float) -> dict[str, Any]:
    """Run the generator (this module) in a child process; what it wrote, parsed."""
    body_file = Path(f"/tmp/nograd-load-{os.getpid()}-{time.monotonic_ns()}.json")
    body_file.write_bytes(body)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests.e2e.open_loop", url, path, str(body_file), *args],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=timeout_s,
        )
    finally:
        body_file.unlink(missing_ok=True)
    document: dict[str, Any] = json.loads(done.stdout)
    return document


def run_open_loop(
    url: str, path: str, body: bytes, rate_per_s: float, duration_s: float, grace_s: float = 60.0
) -> Run:
    """Run the open loop in a child process and collect what it measured."""
    timeout_s = duration_s + grace_s + 30
    document = _child(
        url, path, body, str(rate_per_s), str(duration_s), str(grace_s), timeout_s=timeout_s
    )
    return Run(
        [Outcome(*row) for row in document["outcomes"]], document["cpu_s"], document["wall_s"]
    )


def measure_capacity(
    url: str, path: str, body: bytes, connections: int, duration_s: float
) -> float:
    """Requests answered with 200 per second by ``connections`` clients each sending its next
    request once its last is answered (a closed loop), in a child process."""
    document = _child(
        url, path, body, f"closed:{connections}", str(duration_s), timeout_s=duration_s + 60
    )
    return float(document["answered"]) / float(document["wall_s"])


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, pool: deque[_Connection], answered: Callable[[], None]) -> None:
        self._pool = pool
        self._answered = answered
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._record: list[object] | None = None
        self._scheduled = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def send(self, request: bytes, record: list[object], scheduled: float) -> None:
        assert self.transport is not None
        self._record = record
        self._scheduled = scheduled
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        head_end = self._buffer.find(b"\r\n\r\n")
        if head_end < 0 or self._record is None:
            return
        lines = bytes(self._buffer[:head_end]).decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        if len(self._buffer) < head_end + 4 + length:
            return
        del self._buffer[: head_end + 4 + length]
        record, self._record = self._record, None
        record[1] = int(lines[0].split(" ", 2)[1])
        record[2] = time.perf_counter() - self._scheduled
        record[3] = headers.get("retry-after")
        self._answered()
        if headers.get("connection", "").lower() == "close":
            assert self.transport is not None
            self.transport.close()
        else:
            self._pool.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._record is not None and self._record[1] == -1:
            self._record[1] = 0
            self._record[2] = time.perf_counter() - self._scheduled
            self._record = None
            self._answered()
        if self in self._pool:
            self._pool.remove(self)


def _request(url: str, path: str, body: bytes) -> tuple[str, int, bytes]:
    """The server's host and port, and the bytes of one request with ``body``."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return host, port, head.encode() + body


async def _main(
    url: str, path: str, body: bytes, rate_per_s: float, duration_s: float, grace_s: float
) -> list[list[object]]:
    host, port, request = _request(url, path, body)
    loop = asyncio.get_running_loop()
    pool: deque[_Connection] = deque()
    all_answered = asyncio.Event()
    left = int(rate_per_s * duration_s)

    def answered() -> None:
        nonlocal left
        left -= 1
        if left == 0:
            all_answered.set()

    records: list[list[object]] = []
    pending: set[asyncio.Task[None]] = set()
    count = int(rate_per_s * duration_s)
    start = time.perf_counter() + 0.05

    async def fresh(record: list[object], scheduled: float) -> None:
        try:
            _, connection = await loop.create_connection(
                lambda: _Connection(pool, answered), host, port
            )
        except OSError:
            record[1] = 0
            record[2] = time.perf_counter() - scheduled
            answered()
            return
        connection.send(request, record, scheduled)

    for index in range(count):
        scheduled = start + index / rate_per_s
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        record: list[object] = [scheduled - start, -1, 0.0, None]
        records.append(record)
        if pool:
            pool.popleft().send(request, record, scheduled)
        else:
            task = loop.create_task(fresh(record, scheduled))
            pending.add(task)
            task.add_done_callback(pending.discard)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(all_answered.wait(), grace_s)
    for record in records:
        if record[1] == -1:
            record[1] = 0
            record[2] = time.perf_counter() - start - float(record[0])  # type: ignore[arg-type]
    for connection in list(pool):
        if connection.transport is not None:
            connection.transport.close()
    return records


async def _closed(url: str, path: str, body: bytes, connections: int, duration_s: float) -> int:
    """Requests answered with 200 by ``connections`` clients each sending its next request as
    soon as its last is answered, over ``duration_s``: the server's capacity."""
    host, port, request = _request(url, path, body)
    end = time.perf_counter() + duration_s
    answered = 0

    async def client() -> None:
        nonlocal answered
        reader, writer = await asyncio.open_connection(host, port)
        while time.perf_counter() < end:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.decode("latin-1").split("\r\n"):
                if line.lower().startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            await reader.readexactly(length)
            answered += head.startswith(b"HTTP/1.1 200")
        writer.close()

    await asyncio.gather(*(client() for _ in range(connections)))
    return answered


def main() -> None:
    url, path, body_file, rate, duration = sys.argv[1:6]
    grace = float(sys.argv[6]) if len(sys.argv) > 6 else 60.0
    body = Path(body_file).read_bytes()
    wall = time.perf_counter()
    if rate.startswith("closed:"):
        answered = asyncio.run(_closed(url, path, body, int(rate[7:]), float(duration)))
        json.dump({"answered": answered, "wall_s": time.perf_counter() - wall}, sys.stdout)
        return
    records = asyncio.run(_main(url, path, body, float(rate), float(duration), grace))
    times = time.process_time()
    json.dump(
        {"cpu_s": times, "wall_s": time.perf_counter() - wall, "outcomes": records},
        sys.stdout,
    )


if __name__ == "__main__":
    main()
