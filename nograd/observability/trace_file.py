"""Triton's trace file: a JSON array where each trace is an object naming its model (``id``,
``model_name``, ``model_version``, ``request_id`` when the request has one, ``parent_id`` for an
ensemble step's trace), then one object per timestamp
(``{"id": n, "timestamps": [{"name": ..., "ns": ...}]}``), so Triton's trace summary tools read
nograd's traces.

As in Triton, with ``log_frequency`` N every N traces go to ``<trace_file>.<index>``; with 0
they are held and written to ``<trace_file>`` when the server stops; when ``trace_count`` runs
out, those held are written to the next indexed file at once. Files are written by a thread,
never on the event loop.

Bounded, whatever a client sets: traces are held as their JSON bytes, and once those reach
``max_file_bytes`` they go to the next indexed file whatever the log frequency; only the newest
``max_files`` indexed files are kept (the older are removed as new ones are written); bytes
waiting for the writer thread are bounded by ``max_file_bytes`` too, and traces past that are
dropped and counted (a warning says how many), never queued.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import orjson

from nograd.observability.tracing import Trace

logger = logging.getLogger(__name__)
DEFAULT_MAX_FILE_BYTES: Final = 16 << 20
DEFAULT_MAX_FILES: Final = 16


def entries(trace: Trace) -> list[dict[str, Any]]:
    """One trace's objects in Triton's trace file, then those of its child traces (an
    ensemble's steps, each naming the ensemble's trace as its ``parent_id``)."""
    head: dict[str, Any] = {
        "id": trace.id,
        "model_name": trace.model,
        "model_version": int(trace.version) if trace.version.isdigit() else -1,
    }
    if trace.request_id:
        head["request_id"] = trace.request_id
    if trace.parent_id:
        head["parent_id"] = trace.parent_id
    stamps = sorted(trace.stamps.items(), key=lambda item: item[1])
    found = [head] + [
        {"id": trace.id, "timestamps": [{"name": name, "ns": ns}]} for name, ns in stamps
    ]
    for child in trace.children:
        found.extend(entries(child))
    return found


class TraceFile:
    """Finished traces written to Triton's trace file (or its indexed files), within bounds on
    the bytes held, per file, and the files kept."""

    def __init__(
        self,
        path: Path | None,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_files: int = DEFAULT_MAX_FILES,
    ) -> None:
        self.path = path
        self._max_bytes = max_file_bytes
        self._max_files = max_files
        self._held: list[bytes] = []
        """Each held trace's objects as JSON, without the array's brackets."""
        self._held_bytes = 0
        self._count = 0
        self._index = 0
        self._pending_bytes = 0
        """Bytes handed to the writer thread and not yet written."""
        self.dropped = 0
        """Traces dropped because the writer thread was that many bytes behind."""
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="nograd-trace-file")

    def write(self, trace: Trace, log_frequency: int, exhausted: bool) -> None:
        if self.path is None:
            return
        chunk = orjson.dumps(entries(trace))[1:-1]
        self._held.append(chunk)
        self._held_bytes += len(chunk) + 1
        self._count += 1
        if (
            exhausted
            or (log_frequency > 0 and self._count % log_frequency == 0)
            or self._held_bytes >= self._max_bytes
        ):
            self._flush(indexed=True)

    def _flush(self, *, indexed: bool) -> None:
        if not self._held or self.path is None:
            return
        held, size = self._held, self._held_bytes
        self._held, self._held_bytes = [], 0
        with self._lock:
            behind = self._pending_bytes
            if behind and behind + size > self._max_bytes:
                self._drop(len(held))
                return
            self._pending_bytes += size
        target = self.path.with_name(f"{self.path.name}.{self._index}") if indexed else self.path
        stale = None
        if indexed:
            if self._index >= self._max_files:
                stale = self.path.with_name(f"{self.path.name}.{self._index - self._max_files}")
            self._index += 1
        self._writer.submit(self._save, target, held, size, stale)

    def _drop(self, traces: int) -> None:
        """Count ``traces`` dropped (the caller holds the lock); the first drop is logged."""
        if not self.dropped:
            logger.warning(
                "trace file writes are behind by more than NOGRAD_TRACE_FILE_MAX_BYTES "
                "(%d bytes): traces are dropped until they catch up",
                self._max_bytes,
            )
        self.dropped += traces

    def _save(self, target: Path, held: list[bytes], size: int, stale: Path | None) -> None:
        """The stale file goes first, so the disk never holds more than ``max_files`` at once."""
        try:
            if stale is not None:
                stale.unlink(missing_ok=True)
            target.write_bytes(b"[" + b",".join(held) + b"]")
        except OSError as exc:
            logger.error("trace file %s not written: %s", target, exc)
        finally:
            with self._lock:
                self._pending_bytes -= size

    def close(self) -> None:
        """Write what is held: to ``<trace_file>`` unless indexed files were written already."""
        self._flush(indexed=self._index > 0)
        self._writer.shutdown(wait=True)
        if self.dropped:
            logger.warning("%d traces were dropped: the trace file could not keep up", self.dropped)
