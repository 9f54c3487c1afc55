"""TorchServe archives: unpacked only when every member stays inside its folder and the whole
stays within the archive bounds (members, bytes declared and bytes inflated)."""

from __future__ import annotations

import json
import stat
import zipfile
from pathlib import Path

import pytest

from nograd.formats.torchserve.reading.archives import ArchiveStore, read_archive
from nograd.schema.config import ConfigError

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
        read_archive(path, ArchiveStore(tmp_path / "cache"))
    assert not (tmp_path / "escape.py").exists()
    assert not (tmp_path / "cache").exists()


def test_symbolic_link_refuses_the_archive(tmp_path: Path) -> None:
    link = zipfile.ZipInfo("link")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    path = _archive(tmp_path / "m.mar", link)
    with pytest.raises(ConfigError, match="'link' is a symbolic link"):
        read_archive(path, ArchiveStore(tmp_path / "cache"))


def test_unpacked_once_per_content(tmp_path: Path) -> None:
    path = _archive(tmp_path / "m.mar")
    config, folder, fingerprint = read_archive(path, ArchiveStore(tmp_path / "cache"))
    assert (config.name, config.format, config.max_batch_size) == ("m", "torchserve", 1)
    assert (folder / "h.py").is_file()
    copy = tmp_path / "other" / "copy.mar"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    assert read_archive(copy, ArchiveStore(tmp_path / "cache"))[1:] == (folder, fingerprint)


def _bomb(path: Path, inflated: int) -> Path:
    """An archive with one member of ``inflated`` zero bytes (it compresses a thousandfold)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps(MANIFEST))
        archive.writestr("h.py", "def handle(data, context):\n    return data\n")
        archive.writestr("weights.bin", bytes(inflated))
    return path


def test_too_many_bytes_declared_refuses_the_archive_unread(tmp_path: Path) -> None:
    path = _bomb(tmp_path / "m.mar", 4 << 20)
    assert path.stat().st_size < 64 << 10
    store = ArchiveStore(tmp_path / "cache", max_bytes=1 << 20)
    with pytest.raises(ConfigError, match=r"declares \d+ bytes.*NOGRAD_MAX_ARCHIVE_BYTES"):
        read_archive(path, store)
    assert not (tmp_path / "cache").exists()


def test_understated_sizes_are_stopped_while_inflating(tmp_path: Path) -> None:
    """A zip bomb whose headers declare one byte for a 4 MiB member: the declared total passes,
    inflating stops at the declared size (or nograd's count), and nothing unpacked stays."""
    path = _bomb(tmp_path / "m.mar", 4 << 20)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        member = archive.getinfo("weights.bin")
    central = [i for i in range(len(data)) if data.startswith(b"PK\x01\x02", i)]
    for offset in central:
        name_length = int.from_bytes(data[offset + 28 : offset + 30], "little")
        if bytes(data[offset + 46 : offset + 46 + name_length]) == b"weights.bin":
            data[offset + 24 : offset + 28] = (1).to_bytes(4, "little")  # uncompressed size
    local = member.header_offset
    data[local + 22 : local + 26] = (1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    store = ArchiveStore(tmp_path / "cache", max_bytes=1 << 20)
    with pytest.raises(ConfigError, match=r"m\.mar: (cannot unpack|.*NOGRAD_MAX_ARCHIVE_BYTES)"):
        read_archive(path, store)
    leftovers = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert leftovers == []


def test_too_many_members_refuses_the_archive(tmp_path: Path) -> None:
    path = _archive(tmp_path / "m.mar", zipfile.ZipInfo("extra.txt"))
    with pytest.raises(ConfigError, match=r"holds 3 members.*NOGRAD_MAX_ARCHIVE_MEMBERS"):
        read_archive(path, ArchiveStore(tmp_path / "cache", max_members=2))
    assert read_archive(path, ArchiveStore(tmp_path / "cache", max_members=3))[0].name == "m"
