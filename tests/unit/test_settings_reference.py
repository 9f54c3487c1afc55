"""Every setting shown in its section with its flag, variable and default, in ``nograd --help`` and
in docs/configuration.md, both generated from the Settings class."""

from __future__ import annotations

import inspect
import re

import pytest

from nograd.settings import SETTING_GROUPS, SettingGroup, Settings
from nograd.settings_reference import (
    PAGE_END,
    PAGE_START,
    UNSET,
    grouped_entries,
    grouping_problems,
    help_text,
    with_generated_settings,
)
from tests.e2e.serving import ROOT

PAGE = ROOT / "docs" / "configuration.md"


def help_sections(text: str) -> dict[str, str]:
    """The help's text under each section title, up to the next title."""
    titles = [group.title for group in SETTING_GROUPS]
    pattern = "|".join(re.escape(title) for title in titles)
    pieces = re.split(rf"^({pattern}):$", text, flags=re.MULTILINE)
    return dict(zip(pieces[1::2], pieces[2::2], strict=True))


def test_every_setting_is_in_one_section_with_a_description() -> None:
    assert grouping_problems() == []


def test_a_setting_without_a_section_or_a_description_is_named() -> None:
    class Extended(Settings):
        new_knob: int = 1

    problems = grouping_problems(Extended)
    assert "setting new_knob is in no sections of SETTING_GROUPS" in problems
    assert "setting new_knob has no description (a docstring under the field)" in problems
    # Until it has a section, the help still shows it, last.
    assert help_text(width=100, settings=Extended).endswith(
        "Other:\n  Settings in no section of SETTING_GROUPS yet.\n\n  --new-knob <int>\n"
        "      [env: NOGRAD_NEW_KNOB=] [default: 1]\n"
    )


def test_sections_name_each_setting_once_and_only_settings() -> None:
    network, models = SETTING_GROUPS[0], SETTING_GROUPS[1]
    doubled = (network._replace(fields=(*network.fields, "model_repository")), *SETTING_GROUPS[1:])
    assert grouping_problems(Settings, doubled) == [
        "setting model_repository is in 2 sections of SETTING_GROUPS"
    ]
    unknown = (*SETTING_GROUPS, SettingGroup("Gone", "No longer read.", ("old_knob",)))
    assert grouping_problems(Settings, unknown) == [
        "SETTING_GROUPS names old_knob, which is no setting"
    ]
    swapped = (models, network, *SETTING_GROUPS[2:])
    [problem] = grouping_problems(Settings, swapped)
    assert problem.startswith("the class body is not in the order of SETTING_GROUPS")


def test_help_shows_each_setting_in_its_section_with_its_variable_and_default() -> None:
    sections = help_sections(help_text(width=100))
    assert list(sections) == [group.title for group in SETTING_GROUPS]
    for group in SETTING_GROUPS:
        for name in group.fields:
            flag, variable = "--" + name.replace("_", "-"), "NOGRAD_" + name.upper()
            entry = re.search(
                rf"^  {flag} <[^>]+>\n(?:      .+\n)+?      \[env: {variable}=\]\s+\[default: ",
                sections[group.title],
                flags=re.MULTILINE,
            )
            assert entry, f"{flag} is not under {group.title} with [env: {variable}=]"


def test_help_fits_its_width() -> None:
    for width in (60, 100):
        lines = help_text(width=width).splitlines()
        # Past the width only what cannot be broken: a long word, or a default on its own line.
        wide = [line for line in lines if len(line) > width and len(line.split()) > 1]
        assert all(re.fullmatch(r" +\[default: \S+\]", line) for line in wide), wide


@pytest.mark.parametrize(
    ("name", "value", "default"),
    [
        ("port", "int", "8000"),
        ("workers", "int|auto", "auto"),
        ("log_format", "json|text", "unset"),
        ("warmup", "true|false", "true"),
        ("memory_limit_bytes", "size", "unset"),
        ("warm_evicted_bytes", "size", "512MiB"),
        ("max_request_bytes", "int", "67108864 (64 MiB)"),
        ("max_queue_delay_ms", "float", "2"),
        ("load_models", "text", '""'),
        ("api_keys", "keys", "unset"),
    ],
)
def test_each_value_and_default_is_written_as_a_user_writes_it(
    name: str, value: str, default: str
) -> None:
    flag, variable = "--" + name.replace("_", "-"), "NOGRAD_" + name.upper()
    text = help_text(width=100)
    assert f"  {flag} <{value}>\n" in text
    assert f"[env: {variable}=] [default: {default}]\n" in text


def test_every_default_shown_is_taken_back_by_its_flag() -> None:
    """What the help writes as a default is what a user may write: each one, given to its flag
    as the command reads flags, gives the default back."""
    argv: list[str] = []
    for _, entries in grouped_entries():
        for entry in entries:
            if entry.default != UNSET:
                written = "" if entry.default == '""' else entry.default.split(" (")[0]
                argv += [entry.flag, written]
    parsed = Settings(_cli_parse_args=argv)
    for name, field in Settings.model_fields.items():
        if field.default is not None:
            assert getattr(parsed, name) == field.default, name


def test_a_setting_named_in_a_description_is_written_as_its_variable() -> None:
    text = " ".join(help_text(width=100).split())
    # The docstring says ``model_control = explicit`` and ``operator_api_keys``.
    assert "With `NOGRAD_MODEL_CONTROL=explicit`: load calls may carry" in text
    assert "need a key (`NOGRAD_OPERATOR_API_KEYS`)" in text
    # Its own name is the model config's key: it stays.
    assert "replaces every model's own `max_batch_size`" in text


def test_the_configuration_page_is_what_the_settings_generate() -> None:
    page = PAGE.read_text()
    assert PAGE_START in page and PAGE_END in page
    assert with_generated_settings(page) == page, (
        "docs/configuration.md differs from nograd/settings.py: "
        "run python -m nograd.settings_reference docs/configuration.md"
    )


def test_the_page_lists_every_setting_in_its_section() -> None:
    page = PAGE.read_text()
    for group in SETTING_GROUPS:
        section = page.split(f"\n## {group.title}\n", 1)[1].split("\n## ", 1)[0]
        for name in group.fields:
            assert f"| `NOGRAD_{name.upper()}` | `--{name.replace('_', '-')} <" in section


def test_a_page_without_its_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="no generated part"):
        with_generated_settings("# Configuration\n")


def test_the_class_body_marks_each_section_where_it_starts() -> None:
    """``# --- Title ---`` above each section's first field, so a reader of the class sees the
    sections the help shows."""
    source = inspect.getsource(Settings).splitlines()

    def line_of(text: str) -> int:
        return next(i for i, line in enumerate(source) if line.strip().startswith(text))

    previous_end = 0
    for group in SETTING_GROUPS:
        marker = line_of(f"# --- {group.title} ---")
        first, last = line_of(f"{group.fields[0]}:"), line_of(f"{group.fields[-1]}:")
        assert previous_end < marker < first <= last, group.title
        previous_end = last
