"""BENCHMARKS.md stays a page a reader takes in at once: the method and the latest figures."""

from __future__ import annotations

from pathlib import Path

PAGE = Path(__file__).resolve().parents[3] / "BENCHMARKS.md"
MOST_LINES = 300


def test_the_benchmarks_page_opens_with_its_current_figures_within_300_lines() -> None:
    lines = PAGE.read_text().splitlines()
    assert len(lines) <= MOST_LINES, f"BENCHMARKS.md has {len(lines)} lines, at most {MOST_LINES}"
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[0] == "## Current figures", headings[:3]
