"""The folder a load call's model files are written to: staged whole or not at all, put in place
for the load and taken away again when it fails (the upload it replaced put back), paths kept
inside the model's folder, the uploads kept within their bounds, refused unless turned on under
explicit model control."""

from __future__ import annotations

from pathlib import Path

import pytest

from nograd.serving.control.uploads import (
    STAGING_FOLDER,
    Upload,
    UploadBounds,
    Uploads,
    UploadsFull,
    file_content,
)
from nograd.serving.errors import InvalidInput, PollFailed
from nograd.serving.registry import ModelRegistry

CONFIG = '{"backend": "python", "max_batch_size": 0}'


def put(uploads: Uploads, name: str, upload: Upload) -> None:
    """Stage and place ``upload``, kept as a load that serves keeps it."""
    uploads.place(name, uploads.stage(name, upload)).keep()


def leftovers(folder: Path) -> list[str]:
    """What the uploads folder holds besides the models' folders and an empty staging folder."""
    staging = folder / STAGING_FOLDER
    return sorted(p.name for p in staging.iterdir()) if staging.is_dir() else []


def test_an_upload_is_a_triton_folder_replaced_whole_and_forgotten(tmp_path: Path) -> None:
    uploads = Uploads(tmp_path / "uploads", enabled=True, mode="explicit")
    put(uploads, "m", Upload(CONFIG, {"file:1/model.py": b"a", "file:1/extra.txt": b"b"}))
    folder = tmp_path / "uploads" / "m"
    assert uploads.holds("m")
    assert (folder / "1" / "model.py").read_bytes() == b"a"
    config = (folder / "config.pbtxt").read_text()
    assert 'name: "m"' in config and 'backend: "python"' in config
    put(uploads, "m", Upload(CONFIG, {"file:1/model.py": b"c"}))
    assert sorted(p.name for p in (folder / "1").iterdir()) == ["model.py"]
    uploads.remove("m")
    assert not uploads.holds("m")
    assert [p.name for p in (tmp_path / "uploads").iterdir()] == [STAGING_FOLDER]
    assert leftovers(tmp_path / "uploads") == []


def test_a_failed_load_takes_its_upload_away_and_puts_the_earlier_back(tmp_path: Path) -> None:
    uploads = Uploads(tmp_path / "uploads", enabled=True, mode="explicit")
    put(uploads, "m", Upload(CONFIG, {"file:1/model.py": b"first"}))
    staged = uploads.stage("m", Upload(CONFIG, {"file:1/model.py": b"second"}))
    assert not staged.is_relative_to(tmp_path / "uploads" / "m")
    placement = uploads.place("m", staged)
    assert (tmp_path / "uploads" / "m" / "1" / "model.py").read_bytes() == b"second"
    placement.undo()
    assert (tmp_path / "uploads" / "m" / "1" / "model.py").read_bytes() == b"first"
    # A new model's failed upload leaves nothing; so does a load without files that fails.
    fresh = uploads.place("n", uploads.stage("n", Upload(CONFIG, {"file:1/a.py": b"x"})))
    fresh.undo()
    assert not uploads.holds("n")
    reverted = uploads.place("m", None)
    assert not uploads.holds("m")
    reverted.undo()
    assert uploads.holds("m")
    assert leftovers(tmp_path / "uploads") == []


async def test_a_load_keeps_its_upload_only_if_a_version_of_it_serves(tmp_path: Path) -> None:
    uploads = Uploads(tmp_path / "uploads", enabled=True, mode="explicit")
    registry = ModelRegistry()
    first = uploads.stage("m", Upload(CONFIG, {"file:1/model.py": b"first"}))
    with pytest.raises(RuntimeError, match="no version loaded"):
        async with uploads.placed("m", str(first), registry, lambda name: False):
            registry.unloaded["m"] = "failed to load: no version loaded"
            raise RuntimeError("no version loaded")
    # Nothing of a new model is left: no files, no index row.
    assert not uploads.holds("m") and "m" not in registry.unloaded
    second = uploads.stage("m", Upload(CONFIG, {"file:1/model.py": b"second"}))
    async with uploads.placed("m", str(second), registry, lambda name: False):
        pass
    assert uploads.holds("m")
    # A load left as it is (a TorchServe register) does not touch the upload.
    async with uploads.placed("m", None, registry, lambda name: False):
        assert uploads.holds("m")
    assert leftovers(tmp_path / "uploads") == []


def test_files_staged_for_a_load_that_never_placed_them_are_discarded(tmp_path: Path) -> None:
    uploads = Uploads(tmp_path / "uploads", enabled=True, mode="explicit")
    uploads.discard(uploads.stage("m", Upload(CONFIG, {"file:1/model.py": b"a"})))
    assert not uploads.holds("m") and leftovers(tmp_path / "uploads") == []


def test_uploads_are_kept_within_their_count_and_bytes(tmp_path: Path) -> None:
    bounds = UploadBounds(max_uploads=2, max_bytes=10_000)
    uploads = Uploads(tmp_path / "uploads", enabled=True, mode="explicit", bounds=bounds)
    put(uploads, "a", Upload(CONFIG, {"file:1/model.py": b"a" * 4000}))
    put(uploads, "b", Upload(CONFIG, {"file:1/model.py": b"b"}))
    with pytest.raises(UploadsFull, match="NOGRAD_MAX_UPLOADS=2"):
        uploads.stage("c", Upload(CONFIG, {"file:1/model.py": b"c"}))
    # Replacing a kept upload does not count it twice.
    put(uploads, "b", Upload(CONFIG, {"file:1/model.py": b"b" * 5000}))
    with pytest.raises(UploadsFull, match="NOGRAD_MAX_UPLOAD_BYTES"):
        uploads.stage("b", Upload(CONFIG, {"file:1/model.py": b"b" * 7000}))
    uploads.remove("a")
    put(uploads, "c", Upload(CONFIG, {"file:1/model.py": b"c"}))
    assert leftovers(tmp_path / "uploads") == []


@pytest.mark.parametrize(
    ("files", "config", "reason"),
    [
        ({"file:../m2/model.py": b"a"}, CONFIG, "within the model's folder"),
        ({"file:/etc/x": b"a"}, CONFIG, "within the model's folder"),
        ({"file:": b"a"}, CONFIG, "within the model's folder"),
        ({"file:1/" + "é" * 128: b"a"}, CONFIG, "256 bytes"),
        ({"file:config.pbtxt": b"a"}, CONFIG, "sent as 'config'"),
        ({"file:1/model.py": b"a"}, None, "'config' must be specified"),
        ({"file:1/model.py": b"a"}, "[1]", "invalid config override"),
        ({"file:1/model.py": b"a"}, '{"max_batch_sise": 1}', "invalid config override"),
        ({"file:1/model.py": b"a"}, '{"name": "n"}', "differs from the model's"),
    ],
)
def test_a_bad_upload_writes_nothing(
    tmp_path: Path, files: dict[str, bytes], config: str | None, reason: str
) -> None:
    uploads = Uploads(tmp_path / "uploads", enabled=True, mode="explicit")
    with pytest.raises(PollFailed, match=reason):
        uploads.stage("m", Upload(config, files))
    assert not uploads.holds("m")
    assert not (tmp_path / "m2").exists() and not (tmp_path / "uploads" / "m2").exists()
    assert leftovers(tmp_path / "uploads") == []


@pytest.mark.parametrize(
    ("files", "config", "reason"),
    [
        ({"file:1/mo\0del.py": b"a"}, CONFIG, "NUL character"),
        ({"file:1/model.py": b"a"}, "[" * 20_000 + "]" * 20_000, "nested too deeply"),
    ],
)
def test_a_malformed_upload_is_the_clients_mistake(
    tmp_path: Path, files: dict[str, bytes], config: str, reason: str
) -> None:
    uploads = Uploads(tmp_path / "uploads", enabled=True, mode="explicit")
    with pytest.raises(InvalidInput, match=reason):
        uploads.stage("m", Upload(config, files))
    assert leftovers(tmp_path / "uploads") == []


def test_uploads_are_refused_unless_on_and_explicit(tmp_path: Path) -> None:
    upload = Upload(CONFIG, {"file:1/model.py": b"a"})
    with pytest.raises(InvalidInput, match="NOGRAD_MODEL_UPLOADS"):
        Uploads(tmp_path, enabled=False, mode="explicit").stage("m", upload)
    with pytest.raises(InvalidInput, match="explicit"):
        Uploads(tmp_path, enabled=True, mode="on_demand").stage("m", upload)
    assert list(tmp_path.iterdir()) == []


def test_a_private_folder_is_made_when_needed_and_removed_at_close() -> None:
    uploads = Uploads(None, enabled=True, mode="explicit")
    uploads.remove("m")
    uploads.place("m", None).keep()  # a load without files: nothing to set aside
    assert uploads.server_paths() == []
    put(uploads, "m", Upload(CONFIG, {"file:1/model.py": b"a"}))
    folder = uploads.folder
    assert uploads.holds("m")
    uploads.close()
    assert not folder.exists()


def test_file_contents_are_raw_bytes_or_base64_text() -> None:
    assert file_content("file:a", b"\x00\x01") == b"\x00\x01"
    assert file_content("file:a", "AAE=") == b"\x00\x01"
    with pytest.raises(InvalidInput, match="not base64"):
        file_content("file:a", "AAE")
