"""The engine cache writes inside its folder only, whatever the file name it is given."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from nograd.runtime.engines import artifacts
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


def test_a_file_digest_is_remembered_until_the_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model loaded again (evicted on demand, then asked for) is recognised without reading
    its weights file whole again; a file rewritten is read again."""
    weights = tmp_path / "model.onnx"
    weights.write_bytes(b"first")
    first = artifacts.file_sha256(weights)
    assert first == hashlib.sha256(b"first").digest()

    def read_again(*args: object) -> None:
        raise AssertionError("an unchanged file was read again")

    with monkeypatch.context() as patched:
        patched.setattr(artifacts, "hash_file", read_again)
        assert artifacts.file_sha256(weights) == first
    weights.write_bytes(b"other")
    assert artifacts.file_sha256(weights) == hashlib.sha256(b"other").digest()


def test_a_file_digest_recorded_in_the_cache_serves_a_new_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first load after a restart recognises its weights by the record an earlier process
    left in the engine cache, without reading them whole; a rewritten file is read again, and
    an unreadable record is read past."""
    weights, cache = tmp_path / "model.onnx", tmp_path / "cache"
    weights.write_bytes(b"first")
    first = artifacts.file_sha256(weights, cache)
    assert first == hashlib.sha256(b"first").digest()
    (record,) = cache.glob("file-sha256-*.txt")

    def read_again(*args: object) -> None:
        raise AssertionError("an unchanged file was read again")

    with monkeypatch.context() as patched:
        patched.setattr(artifacts, "_file_digests", {})  # a new process
        patched.setattr(artifacts, "hash_file", read_again)
        assert artifacts.file_sha256(weights, cache) == first
    record.write_text("not a digest")
    monkeypatch.setattr(artifacts, "_file_digests", {})
    assert artifacts.file_sha256(weights, cache) == first
    weights.write_bytes(b"other")
    monkeypatch.setattr(artifacts, "_file_digests", {})
    assert artifacts.file_sha256(weights, cache) == hashlib.sha256(b"other").digest()
    # A file's record is written over when it changes; the record of a file gone goes when
    # another is written: one record per model file there is, whatever a client uploads.
    assert list(cache.glob("file-sha256-*.txt")) == [record]
    second = tmp_path / "second.onnx"
    second.write_bytes(b"second")
    artifacts.file_sha256(second, cache)
    assert len(list(cache.glob("file-sha256-*.txt"))) == 2
    weights.unlink()
    third = tmp_path / "third.onnx"
    third.write_bytes(b"third")
    artifacts.file_sha256(third, cache)
    named = sorted(r.read_text().split("\n")[0] for r in cache.glob("file-sha256-*.txt"))
    assert named == sorted(str(p.resolve()) for p in (second, third))
