"""Files advised into and out of the page cache: every readable file is advised and counted,
one that is gone is skipped rather than failing an eviction."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nograd.host.page_cache import drop_cached, keep_warm, model_files

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")


def test_files_are_advised_and_missing_ones_skipped(tmp_path: Path) -> None:
    folder = tmp_path / "m" / "1"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"w" * 4096)
    (tmp_path / "m" / "config.pbtxt").write_text("name: 'm'")
    files = model_files([tmp_path / "m"])
    assert sorted(size for _, size in files) == [9, 4096]
    paths = [path for path, _ in files]
    assert drop_cached(paths) == 4105
    assert keep_warm([*paths, tmp_path / "gone"]) == 4105
