"""Error texts as a client reads them: without the server's own folders (where its repository,
uploads, caches and code live) or its code's file names and lines. The operator's log keeps the
whole text; the client learns what is wrong with what it sent or named, in its own terms."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Final

_ABSOLUTE: Final = re.compile(r"(?<![\w.~-])/(?:[^\s'\"/:,()\[\]]+/)+([^\s'\"/:,()\[\]]+)")
"""An absolute path of two names or more; group 1 is its last name."""
_CODE_LINE: Final = re.compile(r"""File "([^"]*)", line \d+(, in \S+)?""")
"""A traceback's frame: ``File "x.py", line 3, in f``."""


def without_server_paths(text: str, roots: Iterable[Path]) -> str:
    """``text`` with each path under one of ``roots`` written from that root (``m/config.pbtxt``,
    what the client knows the model by), any other absolute path cut to its last name, and
    traceback frames left out."""
    for root in sorted(_spellings(roots), key=len, reverse=True):
        text = text.replace(root + "/", "").replace(root, ".")
    text = _CODE_LINE.sub(lambda frame: f"in {Path(frame.group(1)).name}", text)
    return _ABSOLUTE.sub(lambda path: path.group(1), text)


def _spellings(roots: Iterable[Path]) -> set[str]:
    """Each absolute root as configured and as resolved (through a symbolic link)."""
    spelled: set[str] = set()
    for root in roots:
        spelled.add(str(root))
        try:
            spelled.add(str(root.resolve()))
        except (OSError, RuntimeError):
            continue
    return {s.rstrip("/") for s in spelled if s.startswith("/") and s != "/"}
