"""The engine cache writes inside its folder only, whatever the file name it is given."""

from __future__ import annotations

from pathlib import Path

import pytest

from nograd.runtime.engines.artifacts import cached
from nograd.runtime.engines.errors import ArtifactError


class Builder:
    """Stands in for an engine's build: writes a small file at the target and remembers it."""

    def __init__(self) -> None:
        self.targets: list[Path] = []

    def __call__(self, target: Path) -> Path:
        self.targets.append(target)
        target.write_bytes(b"artifact")
        return target


def test_a_file_name_that_walks_out_of_the_cache_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    build = Builder()
    absolute = str(tmp_path / "outside")
    for label in ("digits-vx/../../outside/pwn", "../outside", absolute, "m\0"):
        with pytest.raises(ArtifactError, match="inside the cache folder"):
            cached(cache, label, "onnx", "key", build)
    assert build.targets == []
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_planted_link_out_of_the_cache_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    elsewhere = tmp_path / "elsewhere.onnx"
    elsewhere.write_bytes(b"not built by nograd")
    (cache / "m-v1-onnx-key.onnx").symlink_to(elsewhere)
    build = Builder()
    with pytest.raises(ArtifactError, match="inside the cache folder"):
        cached(cache, "m-v1", "onnx", "key", build)
    assert build.targets == []


def test_an_artifact_is_built_once_inside_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    build = Builder()
    first = cached(cache, "m-v1", "onnx", "key", build)
    again = cached(cache, "m-v1", "onnx", "key", build)
    assert first == again == cache.resolve() / "m-v1-onnx-key.onnx"
    assert build.targets == [first]
