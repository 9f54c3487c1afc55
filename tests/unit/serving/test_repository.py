"""The repository on disk: versions found, their configs, and fingerprints that change exactly
when a version's files or override change."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from nograd.schema.config import ConfigError
from nograd.serving.control.repository import OVERRIDABLE, read_model, read_wanted, scan
from tests.unit.conftest import FIXTURES


def poison(root: Path, folder: str = "poison") -> Path:
    shutil.copytree(FIXTURES / "poison", root / folder)
    return root / folder


def test_a_folder_without_numbered_versions_is_one_version(tmp_path: Path) -> None:
    source = read_model(poison(tmp_path))
    assert source is not None and list(source.versions) == ["1"]
    version = source.versions["1"]
    assert version.directory == tmp_path / "poison"
    code = tmp_path / "poison" / "model.py"
    os.utime(code, ns=(1, 1))
    again = read_model(tmp_path / "poison")
    assert again is not None and again.versions["1"].fingerprint != version.fingerprint


def test_numbered_versions_take_their_folder_s_name_and_own_config(tmp_path: Path) -> None:
    folder = poison(tmp_path)
    (folder / "1").mkdir()
    (folder / "2").mkdir()
    own = (folder / "config.toml").read_text().replace("max_batch_size = 64", "max_batch_size = 8")
    (folder / "2" / "config.toml").write_text(own)
    source = read_model(folder)
    assert source is not None and list(source.versions) == ["2"]
    assert source.versions["2"].config.version == "2"
    assert source.versions["2"].config.max_batch_size == 8
    assert source.versions["2"].directory == folder / "2"

    (folder / "2" / "config.toml").write_text(own.replace('name = "poison"', 'name = "other"'))
    with pytest.raises(ConfigError, match="differs from the model's 'poison'"):
        read_model(folder)


def test_an_override_changes_the_config_and_the_fingerprint(tmp_path: Path) -> None:
    folder = poison(tmp_path)
    plain = read_model(folder)
    changed = read_model(folder, {"max_batch_size": 4})
    assert plain is not None and changed is not None
    assert changed.versions["1"].config.max_batch_size == 4
    assert changed.versions["1"].fingerprint != plain.versions["1"].fingerprint


def test_the_versions_recorded_are_read_with_their_overrides_whatever_the_policy(
    tmp_path: Path,
) -> None:
    # What a restarted worker reads: the versions its siblings serve, not those the policy
    # would select now that a newer folder is on disk; a version removed since is left out.
    folder = poison(tmp_path)
    for version in ("1", "2", "3"):
        (folder / version).mkdir()
    source = read_wanted(folder, {"2": None, "1": {"max_batch_size": 4}, "7": None})
    assert source is not None and list(source.versions) == ["1", "2"]
    assert source.versions["1"].config.max_batch_size == 4
    assert source.versions["1"].override == {"max_batch_size": 4}
    assert source.versions["2"].config.max_batch_size == 64
    assert source.versions["2"].override is None
    with pytest.raises(ConfigError, match="'module' cannot be overridden"):
        read_wanted(folder, {"1": {"module": "other.py"}})


def test_scan_names_duplicates_and_skips_folders_without_config(tmp_path: Path) -> None:
    poison(tmp_path, "a")
    poison(tmp_path, "b")
    (tmp_path / "notes").mkdir()
    found, problems = scan(tmp_path)
    assert list(found) == ["poison"]
    assert len(problems) == 1 and "defined twice" in problems[0]


@pytest.mark.parametrize(
    "override",
    [
        {"version": "x/../../../../tmp/pwn"},
        {"name": "evil1"},
        {"module": "train.py"},
        {"artifact_sha256": None},
        {"weights": "other.safetensors"},
        {"device": "cpu"},
        {"engine": "onnx"},
        {"version_policy": "all"},
    ],
)
def test_an_override_of_anything_but_batching_is_refused_naming_the_field(
    tmp_path: Path, override: dict[str, object]
) -> None:
    folder = poison(tmp_path)
    (field,) = override
    with pytest.raises(ConfigError) as refused:
        read_model(folder, {**override, "max_batch_size": 4})
    message = str(refused.value)
    assert f"field(s) {field!r} cannot be overridden" in message
    assert all(allowed in message for allowed in OVERRIDABLE), message


def test_every_batching_and_queueing_field_may_be_overridden(tmp_path: Path) -> None:
    override = {
        "max_batch_size": 4,
        "max_queue_delay_ms": 0.5,
        "max_queue_size": 7,
        "max_batch_tokens": 512,
    }
    assert set(override) == set(OVERRIDABLE)
    source = read_model(poison(tmp_path), override)
    assert source is not None
    config = source.versions["1"].config
    assert config.model_dump(include=set(OVERRIDABLE)) == override
    assert (config.name, config.version, config.module) == ("poison", "1", "model.py")


def test_a_refused_override_is_a_problem_of_its_model_alone_in_a_scan(tmp_path: Path) -> None:
    # A restarted worker reloads the overrides its siblings recorded: one that the rule refuses
    # (written by hand, or by an older nograd) keeps that model out, not the whole repository.
    poison(tmp_path)
    shutil.copytree(FIXTURES / "slow", tmp_path / "slow")
    found, problems = scan(tmp_path, {"poison": {"1": {"module": "other.py"}}})
    assert list(found) == ["slow"]
    assert len(problems) == 1 and "'module' cannot be overridden" in problems[0]


def test_only_ascii_digit_folders_are_versions(tmp_path: Path) -> None:
    folder = poison(tmp_path)
    for name in ("2", "\u00b2", "1" * 19, "v3"):
        (folder / name).mkdir()
    source = read_model(folder)
    assert source is not None and list(source.versions) == ["2"]


@pytest.mark.parametrize(
    ("override", "bound"),
    [
        ({"max_queue_size": 65537}, 65536),
        ({"max_queue_size": "999999999999"}, 65536),
        ({"max_queue_size": 0}, 65536),
        ({"max_batch_tokens": 10**12}, 1 << 20),
        ({"max_batch_tokens": 1.5}, 1 << 20),
    ],
)
def test_an_override_past_its_bound_is_refused_naming_the_field_and_bound(
    tmp_path: Path, override: dict[str, object], bound: int
) -> None:
    folder = poison(tmp_path)
    (field,) = override
    with pytest.raises(ConfigError) as refused:
        read_model(folder, override)
    assert f"{field!r} must be a whole number from 1 to {bound}" in str(refused.value)
    at_bound = read_model(folder, {field: bound})
    assert at_bound is not None
    assert getattr(at_bound.versions["1"].config, field) == bound
