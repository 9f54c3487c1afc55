"""Where sampled traces go: Triton's file name for one engine beside its fronts, as for one
process; a file per worker only where several workers each write their own."""

from __future__ import annotations

import os
from pathlib import Path

from nograd.observability.trace_file import TraceFile
from nograd.serving.extensions.diagnostics import trace_sink
from nograd.settings import Settings


def test_one_engine_beside_fronts_writes_triton_s_file_name(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    for settings in (
        Settings(trace_file=path, workers=1, fronts=2),
        Settings(trace_file=path, workers=1, fronts=0),
    ):
        sink = trace_sink(settings)
        assert isinstance(sink, TraceFile) and sink.path == path


def test_each_of_several_workers_writes_a_file_of_its_own(tmp_path: Path) -> None:
    sink = trace_sink(Settings(trace_file=tmp_path / "trace.json", workers=2, fronts=0))
    assert isinstance(sink, TraceFile)
    assert sink.path == tmp_path / f"trace.json.w{os.getpid()}"
