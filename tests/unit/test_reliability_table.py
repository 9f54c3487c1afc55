"""docs/reliability.md's table of what a client can make the server hold: every row names its
setting and a test that exists, so the table cannot promise a bound nobody checks."""

from __future__ import annotations

import re
from pathlib import Path

from nograd.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
TITLE = "## What a client can make the server hold"
TEST_REFERENCE = re.compile(r"`(tests/[^`:]+\.py)((?:::[A-Za-z0-9_]+)?)`|`::([A-Za-z0-9_]+)`")
SETTING = re.compile(r"`(NOGRAD_[A-Z0-9_]+)`")
BALANCER_CONFIG = ROOT / "deploy" / "fleet" / "haproxy.cfg"
BALANCER_VARIABLE = re.compile(r"\$\{(NOGRAD_FLEET_[A-Z0-9_]+)")


def _rows() -> list[list[str]]:
    text = (ROOT / "docs" / "reliability.md").read_text()
    start = text.index(TITLE)
    end = text.find("\n## ", start + len(TITLE))
    lines = text[start : end if end != -1 else len(text)].splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| Resource")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def _defines(path: Path, name: str) -> bool:
    return re.search(rf"^\s*(async )?def {name}\(", path.read_text(), re.MULTILINE) is not None


def test_the_table_has_one_row_per_resource_with_five_cells() -> None:
    rows = _rows()
    assert len(rows) >= 30
    assert all(len(row) == 5 for row in rows), [row for row in rows if len(row) != 5]
    resources = [row[0] for row in rows]
    assert len(resources) == len(set(resources))


def test_every_row_names_a_test_that_exists() -> None:
    for resource, _bound, _setting, _past, tests in _rows():
        if tests == "same tests":
            continue
        references = list(TEST_REFERENCE.finditer(tests))
        assert references, f"row {resource!r} names no test"
        current: Path | None = None
        for match in references:
            if match.group(1):
                current = ROOT / match.group(1)
                assert current.is_file(), f"row {resource!r}: {match.group(1)} does not exist"
            name = (match.group(2) or "").removeprefix("::") or match.group(3)
            if name:
                assert current is not None
                assert _defines(current, name), f"row {resource!r}: no test {name} in {current}"


def test_every_setting_the_table_names_is_a_setting() -> None:
    """A server setting, or a variable the fleet's balancer configuration reads."""
    known = {f"NOGRAD_{name.upper()}" for name in Settings.model_fields}
    known |= set(BALANCER_VARIABLE.findall(BALANCER_CONFIG.read_text()))
    named = {setting for row in _rows() for setting in SETTING.findall(row[2])}
    assert named, "the table names no setting"
    assert named <= known, sorted(named - known)
