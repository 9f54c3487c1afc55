"""TorchServe archives: unpacked only when every member stays inside its folder."""

from __future__ import annotations

import json
import stat
import zipfile
from pathlib import Path

import pytest

from nograd.runtime.config import ConfigError
from nograd.serving.archives import read_archive

MANIFEST = {"model": {"modelName": "m", "modelVersion": "1.0", "handler": "h.py"}}


def _archive(path: Path, extra: zipfile.ZipInfo | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps(MANIFEST))
        archive.writestr("h.py", "def handle(data, context):\n    return data\n")
        if extra is not None:
            archive.writestr(extra, b"x")
    return path


@pytest.mark.parametrize("name", ["../escape.py", "/etc/evil", "a/../../escape"])
def test_member_outside_the_folder_refuses_the_archive(tmp_path: Path, name: str) -> None:
    path = _archive(tmp_path / "m.mar", zipfile.ZipInfo(name))
    with pytest.raises(ConfigError, match="outside the archive's folder"):
        read_archive(path, tmp_path / "cache")
    assert not (tmp_path / "escape.py").exists()
    assert not (tmp_path / "cache").exists()


def test_symbolic_link_refuses_the_archive(tmp_path: Path) -> None:
    link = zipfile.ZipInfo("link")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    path = _archive(tmp_path / "m.mar", link)
    with pytest.raises(ConfigError, match="'link' is a symbolic link"):
        read_archive(path, tmp_path / "cache")


def test_unpacked_once_per_content(tmp_path: Path) -> None:
    path = _archive(tmp_path / "m.mar")
    config, folder, fingerprint = read_archive(path, tmp_path / "cache")
    assert (config.name, config.format, config.max_batch_size) == ("m", "torchserve", 1)
    assert (folder / "h.py").is_file()
    copy = tmp_path / "other" / "copy.mar"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    assert read_archive(copy, tmp_path / "cache")[1:] == (folder, fingerprint)
