"""The folder a load call's model files are written to: written whole or not at all, paths kept
inside the model's folder, refused unless turned on under explicit model control."""

from __future__ import annotations

from pathlib import Path

import pytest

from nograd.serving.errors import InvalidInput, PollFailed
from nograd.serving.uploads import Upload, Uploads, file_content

CONFIG = '{"backend": "python", "max_batch_size": 0}'


def test_an_upload_is_a_triton_folder_replaced_whole_and_forgotten(tmp_path: Path) -> None:
    uploads = Uploads(tmp_path / "uploads", enabled=True, mode="explicit")
    uploads.write("m", Upload(CONFIG, {"file:1/model.py": b"a", "file:1/extra.txt": b"b"}))
    folder = tmp_path / "uploads" / "m"
    assert uploads.holds("m")
    assert (folder / "1" / "model.py").read_bytes() == b"a"
    config = (folder / "config.pbtxt").read_text()
    assert 'name: "m"' in config and 'backend: "python"' in config
    uploads.write("m", Upload(CONFIG, {"file:1/model.py": b"c"}))
    assert sorted(p.name for p in (folder / "1").iterdir()) == ["model.py"]
    uploads.remove("m")
    assert not uploads.holds("m")
    assert list((tmp_path / "uploads").iterdir()) == []


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
        uploads.write("m", Upload(config, files))
    assert not uploads.holds("m")
    assert not (tmp_path / "m2").exists() and not (tmp_path / "uploads" / "m2").exists()


def test_uploads_are_refused_unless_on_and_explicit(tmp_path: Path) -> None:
    upload = Upload(CONFIG, {"file:1/model.py": b"a"})
    with pytest.raises(InvalidInput, match="NOGRAD_MODEL_UPLOADS"):
        Uploads(tmp_path, enabled=False, mode="explicit").write("m", upload)
    with pytest.raises(InvalidInput, match="explicit"):
        Uploads(tmp_path, enabled=True, mode="on_demand").write("m", upload)
    assert list(tmp_path.iterdir()) == []


def test_a_private_folder_is_made_when_needed_and_removed_at_close() -> None:
    uploads = Uploads(None, enabled=True, mode="explicit")
    uploads.remove("m")
    uploads.write("m", Upload(CONFIG, {"file:1/model.py": b"a"}))
    folder = uploads.folder
    assert uploads.holds("m")
    uploads.close()
    assert not folder.exists()


def test_file_contents_are_raw_bytes_or_base64_text() -> None:
    assert file_content("file:a", b"\x00\x01") == b"\x00\x01"
    assert file_content("file:a", "AAE=") == b"\x00\x01"
    with pytest.raises(InvalidInput, match="not base64"):
        file_content("file:a", "AAE")
