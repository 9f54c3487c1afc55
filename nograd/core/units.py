"""Sizes as people read them, for log lines and tables: one rendering every layer shares, so the
memory plan, the start-up summary and the log formatters show the same bytes the same way."""

from __future__ import annotations

import math


def format_bytes(value: float) -> str:
    """Binary-prefixed size, compact enough for a fixed-width log table."""
    if not math.isfinite(value):
        return str(value)
    size = float(value)
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or suffix == "TiB":
            return f"{size:.0f} {suffix}" if suffix == "B" else f"{size:.1f} {suffix}"
        size /= 1024
    raise AssertionError("unreachable")
