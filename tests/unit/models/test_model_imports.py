"""Shipped and fixture models import nothing of nograd but its public SDK."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MODEL_FILES = sorted(
    [
        *(ROOT / "models").glob("*/model.py"),
        *(ROOT / "tests" / "fixtures" / "models").glob("*/*.py"),
    ]
)


def nograd_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(name for name in names if name.split(".")[0] == "nograd")
    return found


def test_the_model_files_are_found() -> None:
    assert {p.parent.name for p in MODEL_FILES} >= {"digits", "minilm", "poison", "slow", "oomy"}


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_model_imports_only_the_sdk(path: Path) -> None:
    assert nograd_imports(path) <= {"nograd.sdk"}
