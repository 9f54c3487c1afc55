"""The OpenMP spin count a single-process server sets before torch loads its OpenMP runtime."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from nograd.host.openmp import SPIN_COUNT, tune_openmp_wait


@pytest.fixture
def torch_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's CLI tunes before torch is imported; this test process may have it loaded."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)


@pytest.mark.usefixtures("torch_not_loaded")
def test_single_process_spins() -> None:
    environ: dict[str, str] = {}
    assert tune_openmp_wait(environ, workers=1)
    assert environ == {"GOMP_SPINCOUNT": SPIN_COUNT}


@pytest.mark.usefixtures("torch_not_loaded")
def test_workers_sharing_cores_keep_the_default() -> None:
    environ: dict[str, str] = {}
    assert not tune_openmp_wait(environ, workers=2)
    assert environ == {}


@pytest.mark.usefixtures("torch_not_loaded")
@pytest.mark.parametrize("name", ["GOMP_SPINCOUNT", "OMP_WAIT_POLICY"])
def test_the_operators_setting_wins(name: str) -> None:
    value = "PASSIVE" if name == "OMP_WAIT_POLICY" else "42"
    environ = {name: value}
    assert not tune_openmp_wait(environ, workers=1)
    assert environ == {name: value}


def test_too_late_once_torch_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch", ModuleType("torch")))
    environ: dict[str, str] = {}
    assert not tune_openmp_wait(environ, workers=1)
    assert environ == {}


def test_the_cli_tunes_before_torch_loads() -> None:
    """The CLI (and what it imports before serving) must stay torch-free, or the setting is
    read by nobody."""
    code = "import sys, nograd.cli; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert result.stdout.strip() == "False"
