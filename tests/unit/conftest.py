"""Helpers the unit tests of several packages share."""

from __future__ import annotations

import shutil
from pathlib import Path

from nograd.observability.metrics import Metrics
from nograd.serving.dataplane import DataPlane
from nograd.settings import Settings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
"""Tiny models that misbehave on purpose: poison samples, slow forwards, fake out-of-memory."""


def plane_for(tmp_path: Path, *names: str, **settings: object) -> DataPlane:
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    for name in names:
        shutil.copytree(FIXTURES / name, repo / name)
    return DataPlane(Settings(model_repository=repo, **settings), Metrics())  # type: ignore[arg-type]
