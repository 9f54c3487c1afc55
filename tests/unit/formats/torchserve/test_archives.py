"""TorchServe archives: read without unpacking, unpacked only when a version loads from them and
only when every member stays inside its folder and the whole stays within the archive bounds
(members, bytes declared and bytes inflated), a manifest naming only the archive's own files;
an unpacked folder is removed once no live process holds it."""

from __future__ import annotations

import json
import os
import stat
import zipfile
from pathlib import Path

import pytest

from nograd.formats.torchserve.reading.archives import (
    HOLDERS,
    LOCK_FILE,
    ArchiveStore,
    hold,
    read_archive,
    release,
    release_all,
    sweep,
)
from nograd.schema.config import ConfigError
from nograd.serving.control.repository import files_bytes, read_archive_source

MANIFEST = {"model": {"modelName": "m", "modelVersion": "1.0", "handler": "h.py"}}


def _archive(
    path: Path, extra: zipfile.ZipInfo | None = None, manifest: dict[str, object] = MANIFEST
) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest))
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


def test_unpacked_once_per_content_when_a_version_loads(tmp_path: Path) -> None:
    path = _archive(tmp_path / "m.mar")
    config, folder, fingerprint = read_archive(path, ArchiveStore(tmp_path / "cache"))
    assert (config.name, config.format, config.max_batch_size) == ("m", "torchserve", 1)
    assert not folder.exists()
    assert hold(folder) == folder and (folder / "h.py").is_file()
    copy = tmp_path / "other" / "copy.mar"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    assert read_archive(copy, ArchiveStore(tmp_path / "cache"))[1:] == (folder, fingerprint)
    release(folder)
    assert not folder.exists()


def test_reading_an_archive_unpacks_nothing(tmp_path: Path) -> None:
    """A scan, the index and the describe call read the manifest from the archive: a large
    archive costs nothing on disk until a version loads from it."""
    path = _bomb(tmp_path / "m.mar", 64 << 20)
    config, folder, _ = read_archive(path, ArchiveStore(tmp_path / "cache"))
    assert config.name == "m" and not folder.exists()
    assert not (tmp_path / "cache").exists()


def test_an_archive_not_yet_unpacked_is_sized_as_its_members_declare(tmp_path: Path) -> None:
    """On demand, a first load makes room for what the archive will take unpacked."""
    path = _bomb(tmp_path / "m.mar", 4 << 20)
    source = read_archive_source(path, ArchiveStore(tmp_path / "cache"))
    assert not source.directory.exists()
    assert files_bytes(source) > 4 << 20


@pytest.mark.parametrize(
    ("field", "named"),
    [
        ("configFile", "../../../../etc/hostname"),
        ("configFile", "/etc/hostname"),
        ("serializedFile", "/etc/passwd"),
        ("modelFile", "../model.py"),
    ],
)
def test_a_manifest_naming_a_file_outside_the_archive_is_refused(
    tmp_path: Path, field: str, named: str
) -> None:
    manifest = {"model": {**MANIFEST["model"], field: named}}
    path = _archive(tmp_path / "m.mar", manifest=manifest)
    with pytest.raises(ConfigError, match=f"'model.{field}' names .*outside the archive"):
        read_archive(path, ArchiveStore(tmp_path / "cache"))


def test_an_unpacked_folder_goes_once_no_live_process_holds_it(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path / "cache")
    _, folder, _ = read_archive(_archive(tmp_path / "m.mar"), store)
    hold(folder)
    hold(folder)  # a reload: the new version loads before the old one is freed
    release(folder)
    assert (folder / "h.py").is_file()
    # Held by a live process too (the test's parent stands for a sibling worker), it stays.
    sibling = folder.with_name(folder.name + HOLDERS) / str(os.getppid())
    sibling.touch()
    release(folder)
    assert (folder / "h.py").is_file()
    # A holder that died holds nothing: the sweep at start removes what it left.
    sibling.rename(sibling.with_name("999999999"))
    sweep(store.cache)
    assert sorted(p.name for p in store.cache.iterdir()) == [LOCK_FILE]
    # At stop, every hold of the process goes.
    hold(folder)
    release_all()
    assert sorted(p.name for p in store.cache.iterdir()) == [LOCK_FILE]


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
    _, folder, _ = read_archive(path, store)
    with pytest.raises(ConfigError, match=r"m\.mar: (cannot unpack|.*NOGRAD_MAX_ARCHIVE_BYTES)"):
        hold(folder)
    leftovers = [p for p in (tmp_path / "cache").rglob("*") if p.name != LOCK_FILE]
    assert leftovers == []


def test_too_many_members_refuses_the_archive(tmp_path: Path) -> None:
    path = _archive(tmp_path / "m.mar", zipfile.ZipInfo("extra.txt"))
    with pytest.raises(ConfigError, match=r"holds 3 members.*NOGRAD_MAX_ARCHIVE_MEMBERS"):
        read_archive(path, ArchiveStore(tmp_path / "cache", max_members=2))
    assert read_archive(path, ArchiveStore(tmp_path / "cache", max_members=3))[0].name == "m"
