"""The command composes the layers: the workers' serving function is named, not imported; its
help is the settings' own, printed before anything starts."""

from __future__ import annotations

import pytest

from nograd import server
from nograd.cli import SERVE_ENGINE, SERVE_FRONT, SERVE_WORKER, main
from nograd.front import server as front_server
from nograd.settings_reference import help_text
from nograd.supervisor.worker import load_serve


def test_the_named_serving_function_is_the_servers() -> None:
    assert load_serve(SERVE_WORKER) is server.serve_worker
    assert load_serve(SERVE_ENGINE) is server.serve_engine
    assert load_serve(SERVE_FRONT) is front_server.serve_front


def test_fronts_with_several_workers_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Fronts forward to one engine that holds every model once: several workers beside them
    would be several engines."""
    monkeypatch.setenv("NOGRAD_FRONTS", "2")
    monkeypatch.setenv("NOGRAD_WORKERS", "2")
    with pytest.raises(SystemExit) as stopped:
        main([])
    assert stopped.value.code == 2
    assert "NOGRAD_WORKERS=2 with NOGRAD_FRONTS=2" in caplog.text
    assert "unset NOGRAD_WORKERS" in caplog.text


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--port", "9001", "--help"]])
def test_help_is_the_sectioned_one_and_starts_nothing(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 0
    assert capsys.readouterr().out == help_text()


def test_fronts_without_http_are_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOGRAD_FRONTS", "2")
    monkeypatch.setenv("NOGRAD_PORT", "0")
    monkeypatch.setenv("NOGRAD_GRPC_PORT", "8001")  # gRPC only
    with pytest.raises(SystemExit) as stopped:
        main([])
    assert stopped.value.code == 2
    assert "NOGRAD_FRONTS=2 with NOGRAD_PORT=0: the fronts serve HTTP, which is off" in caplog.text


def test_several_cpu_batches_with_several_workers_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each worker runs one CPU batch at a time, sharing the cores with the others through
    their ledger: several batches are one process's."""
    monkeypatch.setenv("NOGRAD_CPU_BATCHES", "2")
    monkeypatch.setenv("NOGRAD_WORKERS", "2")
    with pytest.raises(SystemExit) as stopped:
        main([])
    assert stopped.value.code == 2
    assert "NOGRAD_CPU_BATCHES=2 with NOGRAD_WORKERS=2" in caplog.text
    assert "unset NOGRAD_WORKERS" in caplog.text
