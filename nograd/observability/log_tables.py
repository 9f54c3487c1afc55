"""Tables in the log: a record whose ``extra=`` carries ``table`` (a list of rows, each a dict of
fields) is written as one JSON object per row in JSON mode, and as an aligned table under its
message in text mode.

Why: a table squeezed into one message arrives in a log shipper as a single string of escaped
newlines, which no query can read; one object per row keeps every column a field (``model``,
``limit``, ``weights_bytes``…) while the record stays one record for levels and filters.

Field names carry their unit, so JSON keeps plain numbers while text shows them as people read
them: ``_bytes`` sizes (``1.5 MiB``), ``_s`` seconds and ``_ms`` milliseconds; ``None`` is ``-``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from nograd.core.units import format_bytes

TABLE_FIELD: Final = "table"
"""The ``extra=`` field that holds a record's rows."""
_UNITS: Final = (
    ("_bytes", format_bytes),
    ("_ms", lambda v: f"{v:.2f}ms"),
    ("_s", lambda v: f"{v:.2f}s"),
)


def table_rows(record_fields: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """The rows a record's fields carry under ``table``, or None when it carries no table (or
    something else under that name, which is then logged as an ordinary field)."""
    rows = record_fields.get(TABLE_FIELD)
    if not isinstance(rows, Sequence) or isinstance(rows, str | bytes):
        return None
    return list(rows) if all(isinstance(row, Mapping) for row in rows) else None


def field_label(key: str) -> str:
    """A field's name as text shows it: without its unit suffix (the value shows the unit)."""
    for suffix, _ in _UNITS:
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)]
    return key


def field_text(key: str, value: object) -> str:
    """A field's value as text shows it: sizes and durations with their unit, floats to six
    significant digits, ``None`` as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, int | float) and not isinstance(value, bool):
        for suffix, render in _UNITS:
            if key.endswith(suffix) and len(key) > len(suffix):
                return str(render(value))
        if isinstance(value, float):
            return f"{value:.6g}"
    return str(value)


def text_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Rows as aligned lines: a header of every field in the order first seen, a rule, then one
    line per row (text left-aligned, numbers right-aligned)."""
    keys: list[str] = []
    for row in rows:
        keys.extend(key for key in row if key not in keys)
    cells = [[field_text(key, row.get(key)) for key in keys] for row in rows]
    header = [field_label(key) for key in keys]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(keys))]
    numeric = [_numeric([row.get(key) for row in rows]) for key in keys]

    def render(line: Sequence[str]) -> str:
        return "  ".join(
            f"{cell:>{width}}" if right else f"{cell:<{width}}"
            for cell, width, right in zip(line, widths, numeric, strict=True)
        ).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return [render(header), rule, *(render(line) for line in cells)]


def _numeric(values: Sequence[object]) -> bool:
    """A column of numbers (``None`` aside): right-aligned."""
    present = [value for value in values if value is not None]
    return bool(present) and all(
        isinstance(value, int | float) and not isinstance(value, bool) for value in present
    )
