"""Triton's trace file: a JSON array where each trace is an object naming its model (``id``,
``model_name``, ``model_version``, ``request_id`` when the request has one, ``parent_id`` for an
ensemble step's trace), then one object per timestamp
(``{"id": n, "timestamps": [{"name": ..., "ns": ...}]}``), so Triton's trace summary tools read
nograd's traces.

As in Triton, with ``log_frequency`` N every N traces go to ``<trace_file>.<index>``; with 0
they are held and written to ``<trace_file>`` when the server stops; when ``trace_count`` runs
out, those held are written to the next indexed file at once. Files are written by a thread,
never on the event loop.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson

from nograd.observability.tracing import Trace

logger = logging.getLogger(__name__)


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
    """Finished traces written to Triton's trace file (or its indexed files)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._held: list[dict[str, Any]] = []
        self._count = 0
        self._index = 0
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="nograd-trace-file")

    def write(self, trace: Trace, log_frequency: int, exhausted: bool) -> None:
        if self.path is None:
            return
        self._held.extend(entries(trace))
        self._count += 1
        if exhausted or (log_frequency > 0 and self._count % log_frequency == 0):
            self._flush(indexed=True)

    def _flush(self, *, indexed: bool) -> None:
        if not self._held or self.path is None:
            return
        target = self.path.with_name(f"{self.path.name}.{self._index}") if indexed else self.path
        if indexed:
            self._index += 1
        held, self._held = self._held, []
        self._writer.submit(self._save, target, held)

    def _save(self, target: Path, held: list[dict[str, Any]]) -> None:
        try:
            with self._lock:
                target.write_bytes(orjson.dumps(held))
        except OSError as exc:
            logger.error("trace file %s not written: %s", target, exc)

    def close(self) -> None:
        """Write what is held: to ``<trace_file>`` unless indexed files were written already."""
        self._flush(indexed=self._index > 0)
        self._writer.shutdown(wait=True)
