"""An operator's shared folder is emptied of what an earlier run left there: its model control
state and the uploads that state served."""

from __future__ import annotations

from pathlib import Path

import pytest

from nograd.serving.control.uploads import UPLOADS_FOLDER
from nograd.supervisor.shared_dir import CONTROL_FOLDER, MULTIPROC_ENV, prepare_shared_dir


def test_an_earlier_runs_state_and_uploads_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))
    (tmp_path / CONTROL_FOLDER).mkdir()
    (tmp_path / CONTROL_FOLDER / "state.json").write_text("{}")
    (tmp_path / UPLOADS_FOLDER / "m" / "1").mkdir(parents=True)
    (tmp_path / UPLOADS_FOLDER / "m" / "1" / "model.py").write_bytes(b"x" * 4096)
    assert prepare_shared_dir() == (tmp_path, False)
    assert list(tmp_path.iterdir()) == []
