"""Helpers the unit tests of several packages share."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from nograd.observability.metrics import Metrics
from nograd.serving import dataplane
from nograd.serving.calls import validation
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


def count_lookups_and_checks(
    monkeypatch: pytest.MonkeyPatch, plane: DataPlane
) -> tuple[list[str], list[str]]:
    """Spies on ``plane``'s registry lookups and on the declared-input check: the model names
    each was called for, in order, so a test counts the per-request steps."""
    lookups: list[str] = []
    checks: list[str] = []
    get, check_declared = plane.registry.get, validation.check_declared

    def counted_get(name: str, version: str | None = None) -> Any:
        lookups.append(name)
        return get(name, version)

    def counted_check(model: Any, *args: Any, **kwargs: Any) -> None:
        checks.append(model.name)
        check_declared(model, *args, **kwargs)

    monkeypatch.setattr(plane.registry, "get", counted_get)
    monkeypatch.setattr(validation, "check_declared", counted_check)
    monkeypatch.setattr(dataplane, "check_declared", counted_check)
    return lookups, checks
