"""Trace settings merged as Triton merges them (a model's unspecified fields follow the global
setting, a cleared one follows it again), sampling by rate and count, the trace file's shape,
and the log switches acting on real loggers."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path

import pytest

from nograd.observability.log_settings import LogSettings
from nograd.observability.trace_file import TraceFile
from nograd.observability.trace_settings import (
    BadSetting,
    FixedSetting,
    TraceSetting,
    TraceSettings,
    document,
)
from nograd.observability.tracing import ACTIVE, Tracer, step_trace


def test_a_model_setting_takes_its_unset_fields_from_the_global_one() -> None:
    settings = TraceSettings(TraceSetting())
    settings.update("m", {"trace_rate": "5"})
    settings.update(None, {"trace_level": ["TIMESTAMPS"], "trace_rate": "50", "trace_count": "3"})
    model = settings.of("m")
    assert (model.level, model.rate, model.count) == ("TIMESTAMPS", 5, 3)
    settings.update("m", {"trace_rate": None})
    assert "m" not in settings.models  # nothing of its own left: the global setting
    assert settings.of("m").rate == 50
    settings.update(None, {"trace_rate": None})
    assert settings.of(None).rate == 1000  # a cleared global field: its start-up value


def test_the_document_is_triton_s_for_each_mode() -> None:
    setting = TraceSetting(level="TIMESTAMPS", rate=2, count=-1, log_frequency=3)
    assert document(setting, "triton", "/t.json", "u") == {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": "2",
        "trace_count": "-1",
        "log_frequency": "3",
        "trace_file": "/t.json",
        "trace_mode": "triton",
    }
    otel = document(setting, "opentelemetry", "", "http://c/v1/traces")
    assert "trace_file" not in otel and otel["url"] == "http://c/v1/traces"


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    [
        ({"trace_rate": "-1"}, BadSetting, "out of range [ 0, 4294967295 ], got: -1"),
        ({"trace_count": "-2"}, BadSetting, "out of range [ -1, 2147483647 ]"),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, BadSetting, "only one trace level 'OFF'"),
        ({"trace_level": ["TENSORS"]}, BadSetting, "'TENSORS' is not supported"),
        ({"trace_mode": "triton"}, FixedSetting, "trace mode can not be updated"),
        ({"nope": "1"}, BadSetting, "unknown trace setting 'nope'"),
    ],
)
def test_bad_changes_are_refused_whole(changes, error, words) -> None:
    settings = TraceSettings(TraceSetting())
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        settings.update(None, {"trace_level": ["TIMESTAMPS"], **changes})
    assert settings.of(None) == TraceSetting()


class _Sink:
    def __init__(self) -> None:
        self.written: list[tuple[int, bool]] = []

    def write(self, trace, log_frequency: int, exhausted: bool) -> None:
        self.written.append((trace.id, exhausted))

    def close(self) -> None:
        pass


def test_every_rate_th_request_is_sampled_until_the_count_runs_out() -> None:
    sink = _Sink()
    tracer = Tracer(TraceSettings(TraceSetting()), sink)
    assert not tracer.active and tracer.begin("m", "r", None) is None
    tracer.update(None, {"trace_level": ["TIMESTAMPS"], "trace_rate": "2", "trace_count": "2"})
    sampled = []
    for index in range(8):
        trace = tracer.begin("m", f"r{index}", None)
        if trace is not None:
            assert ACTIVE.get() is trace
            tracer.end(trace)
            sampled.append(trace.request_id)
        assert ACTIVE.get() is None
    assert sampled == ["r1", "r3"]
    assert sink.written == [(1, False), (2, True)]
    assert tracer.setting(None).count == 0


def test_the_trace_file_is_triton_s_json(tmp_path: Path) -> None:
    sink = TraceFile(tmp_path / "t.json")
    tracer = Tracer(TraceSettings(TraceSetting(level="TIMESTAMPS", rate=1)), sink)
    trace = tracer.begin("m", "req-1", None)
    assert trace is not None
    trace.version = "3"
    tracer.end(trace)
    tracer.close()  # log_frequency 0: written when the server stops
    entries = json.loads((tmp_path / "t.json").read_text())
    head = {"id": trace.id, "model_name": "m", "model_version": 3, "request_id": "req-1"}
    assert entries[0] == head
    assert [e["timestamps"][0]["name"] for e in entries[1:]] == ["REQUEST_START", "REQUEST_END"]


def _traced(tracer: Tracer, count: int, settle: TraceFile | None = None) -> None:
    """``count`` sampled requests; with ``settle``, each waits until that file's writer is idle
    (a disk that keeps up)."""
    for number in range(count):
        trace = tracer.begin("m", f"req-{number}", None)
        assert trace is not None
        tracer.end(trace)
        if settle is not None:
            settle._writer.submit(lambda: None).result()


def test_indexed_trace_files_rotate_keeping_the_newest(tmp_path: Path) -> None:
    """A client that sets ``log_frequency`` 1 makes a file per trace: only the newest
    ``max_files`` stay on disk."""
    sink = TraceFile(tmp_path / "t.json", max_files=3)
    setting = TraceSetting(level="TIMESTAMPS", rate=1, log_frequency=1)
    tracer = Tracer(TraceSettings(setting), sink)
    _traced(tracer, 10)
    tracer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json.7", "t.json.8", "t.json.9"]
    assert json.loads((tmp_path / "t.json.9").read_text())[0]["request_id"] == "req-9"


def test_the_disk_never_holds_more_than_max_files_even_while_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that lists the folder while a file is being written sees at most ``max_files``."""
    seen: list[int] = []
    write_bytes = Path.write_bytes

    def counted(path: Path, data: bytes) -> int:
        written = write_bytes(path, data)
        seen.append(len(list(tmp_path.iterdir())))
        return written

    monkeypatch.setattr(Path, "write_bytes", counted)
    sink = TraceFile(tmp_path / "t.json", max_files=3)
    tracer = Tracer(TraceSettings(TraceSetting(level="TIMESTAMPS", rate=1, log_frequency=1)), sink)
    _traced(tracer, 10, settle=sink)
    tracer.close()
    assert len(seen) == 10 and max(seen) == 3, seen


def test_held_traces_go_to_a_file_at_the_byte_bound(tmp_path: Path) -> None:
    """With ``log_frequency`` 0 Triton holds every trace until the server stops; here they go
    to the next indexed file once their bytes reach the bound, and no file passes it by more
    than one trace."""
    sink = TraceFile(tmp_path / "t.json", max_file_bytes=4096, max_files=100)
    tracer = Tracer(TraceSettings(TraceSetting(level="TIMESTAMPS", rate=1)), sink)
    _traced(tracer, 100, settle=sink)
    tracer.close()
    assert sink.dropped == 0
    files = sorted(tmp_path.iterdir())
    assert len(files) > 1 and all(p.name.startswith("t.json.") for p in files)
    sizes = [p.stat().st_size for p in files]
    assert max(sizes) < 4096 + 512, sizes
    written = [e for p in files for e in json.loads(p.read_text()) if "model_name" in e]
    assert len(written) == 100


def test_traces_past_a_stuck_writer_are_dropped_and_counted(tmp_path: Path) -> None:
    sink = TraceFile(tmp_path / "t.json", max_file_bytes=4096, max_files=1000)
    setting = TraceSetting(level="TIMESTAMPS", rate=1, log_frequency=1)
    tracer = Tracer(TraceSettings(setting), sink)
    stuck = threading.Event()
    sink._writer.submit(stuck.wait)  # the disk stalls
    _traced(tracer, 200)
    assert sink.dropped > 150
    assert sink._pending_bytes <= 4096
    stuck.set()
    tracer.close()
    written = [e for p in tmp_path.iterdir() for e in json.loads(p.read_text())]
    assert len([e for e in written if "model_name" in e]) == 200 - sink.dropped


async def _step(model: str, nested: tuple[str, ...] = ()) -> None:
    with step_trace(model):
        trace = ACTIVE.get()
        assert trace is not None and trace.model == model
        for inner in nested:
            await _step(inner)


def test_an_ensemble_s_steps_are_child_traces_naming_their_parent(tmp_path: Path) -> None:
    sink = TraceFile(tmp_path / "t.json")
    tracer = Tracer(TraceSettings(TraceSetting(level="TIMESTAMPS", rate=1)), sink)
    trace = tracer.begin("outer", "req-2", None)
    assert trace is not None

    async def steps() -> None:
        # Steps run as tasks of their own, as the ensemble runs them; one is an ensemble too.
        await asyncio.gather(
            asyncio.ensure_future(_step("a")), asyncio.ensure_future(_step("inner", ("b",)))
        )

    asyncio.run(steps())
    assert ACTIVE.get() is trace
    tracer.end(trace)
    tracer.close()
    entries = json.loads((tmp_path / "t.json").read_text())
    heads = {e["model_name"]: e for e in entries if "model_name" in e}
    assert "parent_id" not in heads["outer"]
    assert heads["a"]["parent_id"] == heads["inner"]["parent_id"] == trace.id
    assert heads["b"]["parent_id"] == heads["inner"]["id"]
    assert len({h["id"] for h in heads.values()}) == 4
    for head in heads.values():
        mine = [e for e in entries if e["id"] == head["id"] and "timestamps" in e]
        names = [e["timestamps"][0]["name"] for e in mine]
        assert names == ["REQUEST_START", "REQUEST_END"], (head, names)


def test_log_switches_act_on_the_real_loggers(caplog: pytest.LogCaptureFixture) -> None:
    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.INFO)
    logs = LogSettings("text")
    root.addHandler(caplog.handler)
    try:
        logs.update({"log_verbose_level": 1, "log_warning": False})
        logger = logging.getLogger("nograd.test_switches")
        logger.debug("debug line")
        logger.warning("warning line")
        logger.error("error line")
        assert [r.getMessage() for r in caplog.records if "line" in r.getMessage()] == [
            "debug line",
            "error line",
        ]
        with pytest.raises(BadSetting, match="log_verbose_level"):
            logs.update({"log_verbose_level": True})
        with pytest.raises(FixedSetting):
            logs.update({"log_file": "/tmp/x"})
        assert logs.document()["log_verbose_level"] == 1
    finally:
        for handler in [*root.handlers, caplog.handler]:
            handler.removeFilter(logs.switches)
        root.removeHandler(caplog.handler)
        root.setLevel(before)
