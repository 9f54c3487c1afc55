"""The command composes the layers: the workers' serving function is named, not imported; its
help is the settings' own, printed before anything starts."""

from __future__ import annotations

import pytest

from nograd import server
from nograd.cli import SERVE_WORKER, main
from nograd.settings_reference import help_text
from nograd.supervisor.worker import load_serve


def test_the_named_serving_function_is_the_servers() -> None:
    assert load_serve(SERVE_WORKER) is server.serve_worker


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--port", "9001", "--help"]])
def test_help_is_the_sectioned_one_and_starts_nothing(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 0
    assert capsys.readouterr().out == help_text()
