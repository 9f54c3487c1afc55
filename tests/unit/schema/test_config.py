"""Model configs: valid ones load, malformed ones fail naming the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from nograd.schema.config import (
    ConfigError,
    VersionPolicy,
    check_model_name,
    check_version,
    find_config,
    load_config,
)
from tests.e2e.serving import ROOT

GOOD = """
name = "m"
version = 3
max_batch_size = 8
device = "cpu"
[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1, 4]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [2]
"""


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def test_shipped_configs_load() -> None:
    for folder in (ROOT / "models").iterdir():
        path = find_config(folder)
        if path is not None:
            config = load_config(path)
            assert config.name == folder.name


def test_valid_toml_and_yaml(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    assert config.version == "3"
    assert config.inputs[0].shape == (-1, 4)
    yaml_text = (
        "name: m\ninputs: [{name: x, datatype: INT64, shape: [3]}]\n"
        "outputs: [{name: y, datatype: FP32, shape: [1]}]\n"
    )
    assert load_config(write(tmp_path, yaml_text, "config.yaml")).inputs[0].datatype == "INT64"


@pytest.mark.parametrize(
    ("replace", "by", "field"),
    [
        (
            'datatype = "FP32"\nshape = [-1, 4]',
            'datatype = "FLOAT"\nshape = [-1, 4]',
            "inputs.0.datatype",
        ),
        ("shape = [-1, 4]", "shape = [0, 4]", "inputs.0.shape"),
        ('device = "cpu"', 'device = "tpu"', "device"),
        ("max_batch_size = 8", "max_batch_size = 0", "max_batch_size"),
        ("max_batch_size = 8", "max_batch_size = 8\nbatch_sise = 3", "batch_sise"),
        ('name = "m"', 'name = "m"\nmodule = "../evil.py"', "module"),
    ],
)
def test_malformed_config_names_file_and_field(
    tmp_path: Path, replace: str, by: str, field: str
) -> None:
    path = write(tmp_path, GOOD.replace(replace, by))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert f"field '{field}'" in str(info.value)


@pytest.mark.parametrize(
    "version",
    [
        '"x/../../pwn"',
        '".."',
        '"1/2"',
        '"v1"',
        '"1\\u0000"',
        '"\u00b2"',
        '""',
        "1" * 19,
        "-1",
        "true",
    ],
)
def test_a_version_is_digits_only(tmp_path: Path, version: str) -> None:
    # A version names a folder and an engine cache file: text that is not one must never load.
    path = write(tmp_path, GOOD.replace("version = 3", f"version = {version}"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "field 'version'" in str(info.value)


@pytest.mark.parametrize(
    "name",
    ['"../evil"', '".hidden"', '"a/b"', '"m\\n"', '"m\\u0000"', f'"{"m" * 129}"', '""', '"é"'],
)
def test_a_model_name_is_letters_digits_and_punctuation(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, GOOD.replace('name = "m"', f"name = {name}"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "field 'name'" in str(info.value)


def test_valid_names_and_versions_pass_unchanged() -> None:
    assert check_model_name("Model_1.v-2") == "Model_1.v-2"
    assert check_model_name("m" * 128) == "m" * 128
    assert check_version("0") == "0"
    assert check_version("9" * 18) == "9" * 18


def test_unparseable_config(tmp_path: Path) -> None:
    path = write(tmp_path, "name = [unclosed")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(path)


@pytest.mark.parametrize(
    ("policy", "versions", "selected"),
    [
        ({}, ["1", "3", "2"], ["3"]),
        ({"latest": 2}, ["1", "10", "9"], ["9", "10"]),
        ("all", ["2", "1"], ["1", "2"]),
        ({"specific": [1, 3]}, ["1", "2", "3"], ["1", "3"]),
        ({"specific": [7]}, ["1"], []),
    ],
)
def test_the_version_policy_selects_numbered_versions(
    policy: object, versions: list[str], selected: list[str]
) -> None:
    assert VersionPolicy.model_validate(policy).select(versions) == selected


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"latest": 1, "all": True}, "one of latest, specific or all"),
        ({"latest": 0}, "greater than or equal to 1"),
        ({"specific": []}, "at least one version"),
        ({"specific": ["../1"]}, "must be 1 to 18 digits"),
        ("newest", "must be"),
    ],
)
def test_a_bad_version_policy_names_the_field(tmp_path: Path, policy: object, message: str) -> None:
    text = f"version_policy = {_toml(policy)}\n" + GOOD
    with pytest.raises(ConfigError, match="version_policy") as raised:
        load_config(write(tmp_path, text))
    assert message in str(raised.value)


def _toml(value: object) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    assert isinstance(value, dict)
    items = ", ".join(
        f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in value.items()
    )
    return "{ " + items + " }"
