"""A serving process collects its youngest generation once per YOUNG_OBJECTS allocations,
never more often than the interpreter would, and leaves the older generations' thresholds."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator

import pytest

from nograd.host.collector import YOUNG_OBJECTS, collect_young_less_often


@pytest.fixture(autouse=True)
def thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_the_youngest_generation_is_collected_less_often() -> None:
    gc.set_threshold(700, 10, 10)
    collect_young_less_often()
    assert gc.get_threshold() == (YOUNG_OBJECTS, 10, 10)


def test_a_higher_threshold_already_set_is_kept() -> None:
    gc.set_threshold(YOUNG_OBJECTS * 2, 5, 3)
    collect_young_less_often()
    assert gc.get_threshold() == (YOUNG_OBJECTS * 2, 5, 3)


def test_the_command_sets_it_before_serving() -> None:
    """``nograd`` (one process, or the supervisor whose workers set it again as they start)."""
    code = (
        "import gc, nograd.cli as cli, nograd.server\n"
        "nograd.server.serve = lambda settings: (print(gc.get_threshold()[0]), True)[1]\n"
        "cli.main([])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"NOGRAD_MODEL_REPOSITORY": "/nonexistent", "NOGRAD_WORKERS": "1", "PATH": ""},
    )
    assert done.stdout.strip().splitlines()[-1] == str(YOUNG_OBJECTS), done.stderr
