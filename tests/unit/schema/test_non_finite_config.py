"""The per-model ``reject_non_finite`` option: on unless the config turns it off, a bool only."""

from __future__ import annotations

from pathlib import Path

import pytest

from nograd.schema.config import ConfigError, load_config

CONFIG = """
name = "m"
{option}
[[inputs]]
name = "x"
datatype = "FP32"
shape = [2]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [2]
"""


def write(tmp_path: Path, option: str) -> Path:
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    path = folder / "config.toml"
    path.write_text(CONFIG.format(option=option))
    return path


def test_on_by_default_and_off_when_the_config_says_so(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")).reject_non_finite is True
    assert load_config(write(tmp_path, "reject_non_finite = false")).reject_non_finite is False
    assert load_config(write(tmp_path, "reject_non_finite = true")).reject_non_finite is True


@pytest.mark.parametrize("value", ['"maybe"', "2", "[]"])
def test_a_value_that_is_no_bool_is_a_config_error_naming_the_field(
    tmp_path: Path, value: str
) -> None:
    with pytest.raises(ConfigError, match=r"config\.toml: field 'reject_non_finite'"):
        load_config(write(tmp_path, f"reject_non_finite = {value}"))
