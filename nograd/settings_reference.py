"""The settings as a reader meets them: each in its section (``SETTING_GROUPS``) with its flag,
its ``NOGRAD_`` variable, its default and its description, written out as ``nograd --help`` and as
the settings of docs/configuration.md. Both come from the Settings class alone, so neither can
drift from what the server reads.

``python -m nograd.settings_reference docs/configuration.md`` rewrites the page's generated part
(``--check``: only says whether it is current); the rest of the page is written by hand.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BeforeValidator, SecretStr
from pydantic.fields import FieldInfo

from nograd.settings import SETTING_GROUPS, SettingGroup, Settings, parse_size

HELP_USAGE = """\
usage: nograd [--SETTING VALUE ...]
       nograd export MODEL_DIR --to ENGINE [--out DIR]"""
HELP_ABOUT = (
    "Serves the models of a repository over HTTP and gRPC: the Open Inference Protocol with "
    "Triton's extensions, TorchServe's APIs and OpenAI embeddings (building engines: nograd export "
    "--help). Every setting is a flag or an environment variable (named beside it); a flag wins "
    "over its variable. A <size> is bytes or 256MiB style. A model's own settings live in its "
    "config file (docs/models.md); this list is also docs/configuration.md."
)
HELP_FLAG = "  -h, --help\n      Print this help and exit."

PAGE_START = (
    "<!-- The settings below are generated from nograd/settings.py: "
    "python -m nograd.settings_reference docs/configuration.md -->"
)
PAGE_END = "<!-- End of the generated settings. -->"
UNSET = "unset"
UNGROUPED = SettingGroup("Other", "Settings in no section of SETTING_GROUPS yet.", ())
HELP_INDENT = 6
HELP_WIDTHS = (60, 100)
"""Narrowest and widest help, in columns: the terminal's width within these."""
SIZE_SUFFIXES = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))
CODE_SPAN = re.compile(r"``(.+?)``")
SETTING_MENTION = re.compile(r"^(\w+)(?:\s*=\s*(\S+))?$")
DOCS_PAGE = re.compile(r"docs/([\w-]+\.md)(#[\w-]+)?")


@dataclass(frozen=True)
class SettingEntry:
    """One setting as it is shown: every name a user may set it by, and what it takes."""

    name: str
    flag: str
    variable: str
    value: str
    """What the flag takes: ``int``, ``size``, ``none|explicit``, ..."""
    default: str
    description: str


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def variable_of(name: str, settings: type[Settings] = Settings) -> str:
    return f"{settings.model_config.get('env_prefix', '')}{name}".upper()


def accepts_size(field: FieldInfo) -> bool:
    """Whether the field reads ``256MiB`` style (``ByteSize``), its marker found at any depth."""

    def marked(item: Any) -> bool:
        if isinstance(item, BeforeValidator) and item.func is parse_size:
            return True
        return any(marked(arg) for arg in get_args(item))

    return any(marked(item) for item in field.metadata) or marked(field.annotation)


def value_kinds(annotation: Any) -> list[str]:
    """What a value of this type is written as, ``None`` left out (unset is the default)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return value_kinds(get_args(annotation)[0])
    if origin is Literal:
        return [str(choice) for choice in get_args(annotation)]
    if origin in (Union, types.UnionType):
        return [kind for member in get_args(annotation) for kind in value_kinds(member)]
    if annotation is type(None):
        return []
    names = {bool: "true|false", int: "int", float: "float", str: "text", Path: "path"}
    if annotation is SecretStr:
        return ["keys"]
    return [names.get(annotation, getattr(annotation, "__name__", str(annotation)))]


def value_of(field: FieldInfo) -> str:
    return "size" if accepts_size(field) else "|".join(value_kinds(field.annotation))


def size_text(value: int) -> str:
    """The largest binary unit that writes the size exactly: ``512MiB``, ``4GiB``."""
    for unit, suffix in SIZE_SUFFIXES:
        if value >= unit and value % unit == 0:
            return f"{value // unit}{suffix}"
    return str(value)


def default_of(name: str, field: FieldInfo) -> str:
    value = field.default
    if value is None:
        return UNSET
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and not value:
        return '""'
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and accepts_size(field):
        return size_text(value)
    exact = size_text(value) if isinstance(value, int) else ""
    if "bytes" in name.split("_") and exact != str(value):
        # Read as bytes only: the unit is shown apart, as an aid, not as a value to write.
        return f"{value} ({exact[:-3]} {exact[-3:]})"
    return str(value)


def readable(text: str, own: str = "", settings: type[Settings] = Settings) -> str:
    """A docstring on one line, code in single backticks, a setting it names (``port``,
    ``model_control = on_demand``) written as its variable; ``own``, the setting described,
    stays as written: there it is the model config's key of that name."""

    def code(match: re.Match[str]) -> str:
        text = match.group(1)
        mention = SETTING_MENTION.match(text)
        if mention and mention.group(1) != own and mention.group(1) in settings.model_fields:
            variable = variable_of(mention.group(1), settings)
            text = f"{variable}={mention.group(2)}" if mention.group(2) else variable
        return f"`{text}`"

    return CODE_SPAN.sub(code, " ".join(text.split()))


def grouped_entries(
    settings: type[Settings] = Settings, groups: tuple[SettingGroup, ...] = SETTING_GROUPS
) -> list[tuple[SettingGroup, list[SettingEntry]]]:
    """Each section's settings; one in no section yet comes last, under ``UNGROUPED``, so the
    help never hides a setting (``grouping_problems`` fails the tests on it)."""
    fields = settings.model_fields
    listed = {name for group in groups for name in group.fields}
    ungrouped = tuple(name for name in fields if name not in listed)
    if ungrouped:
        groups = (*groups, UNGROUPED._replace(fields=ungrouped))
    return [
        (
            group,
            [
                SettingEntry(
                    name=name,
                    flag=flag_of(name),
                    variable=variable_of(name, settings),
                    value=value_of(fields[name]),
                    default=default_of(name, fields[name]),
                    description=readable(fields[name].description or "", name, settings),
                )
                for name in group.fields
                if name in fields
            ],
        )
        for group in groups
    ]


def grouping_problems(
    settings: type[Settings] = Settings, groups: tuple[SettingGroup, ...] = SETTING_GROUPS
) -> list[str]:
    """What keeps a setting from being shown in its place: no section, two sections, a name no
    field has, no description, or a class body whose order is not the sections'."""
    listed = [name for group in groups for name in group.fields]
    problems: list[str] = []
    for name, field in settings.model_fields.items():
        sections = listed.count(name)
        if sections != 1:
            problems.append(f"setting {name} is in {sections or 'no'} sections of SETTING_GROUPS")
        if not (field.description or "").strip():
            problems.append(f"setting {name} has no description (a docstring under the field)")
    problems += [
        f"SETTING_GROUPS names {name}, which is no setting"
        for name in dict.fromkeys(listed)
        if name not in settings.model_fields
    ]
    fields = list(settings.model_fields)
    in_class = [name for name in fields if name in listed]
    in_groups = [name for name in dict.fromkeys(listed) if name in settings.model_fields]
    if not problems and in_class != in_groups:
        first = next(a for a, b in zip(in_class, in_groups, strict=True) if a != b)
        problems.append(
            f"the class body is not in the order of SETTING_GROUPS (first apart: {first}); "
            "move the field to its section"
        )
    return problems


def help_width() -> int:
    narrowest, widest = HELP_WIDTHS
    return max(narrowest, min(widest, shutil.get_terminal_size((widest, 24)).columns))


def help_text(width: int | None = None, settings: type[Settings] = Settings) -> str:
    """``nograd --help``: each section's settings under its title, each with its description
    and, on a line of their own, its variable and default (as TEI's ``[env: NAME=]``)."""
    width = help_width() if width is None else width

    def wrapped(text: str, indent: int) -> str:
        return textwrap.fill(
            text,
            width,
            initial_indent=" " * indent,
            subsequent_indent=" " * indent,
            break_long_words=False,
            break_on_hyphens=False,
        )

    parts = [HELP_USAGE, wrapped(HELP_ABOUT, 0), HELP_FLAG]
    for group, entries in grouped_entries(settings):
        parts.append(f"{group.title}:\n{wrapped(readable(group.about, settings=settings), 2)}")
        for entry in entries:
            names = f"[env: {entry.variable}=] [default: {entry.default}]"
            if HELP_INDENT + len(names) > width:
                names = names.replace("] [", f"]\n{' ' * HELP_INDENT}[")
            lines = [f"  {entry.flag} <{entry.value}>", wrapped(entry.description, HELP_INDENT)]
            parts.append("\n".join([*filter(None, lines), " " * HELP_INDENT + names]))
    return "\n\n".join(parts) + "\n"


def linked(text: str, page: str = "configuration.md") -> str:
    """Markdown of a sentence that names ``docs/<page>.md``: each such name a link (the page's
    own sections linked by their anchor alone)."""

    def link(match: re.Match[str]) -> str:
        target_page, anchor = match.group(1), match.group(2) or ""
        if target_page == page and anchor:
            return f"[below]({anchor})"
        return f"[{target_page}]({target_page}{anchor})"

    return DOCS_PAGE.sub(link, text)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def default_cell(default: str) -> str:
    """A default as code, but for ``unset``: a word, not a value to write."""
    return default if default == UNSET else f"`{cell(default)}`"


def configuration_block(settings: type[Settings] = Settings) -> str:
    """The generated part of docs/configuration.md: a table per section."""
    parts = [PAGE_START]
    for group, entries in grouped_entries(settings):
        rows = [
            f"| `{entry.variable}` | `{cell(entry.flag)} <{cell(entry.value)}>` | "
            f"{default_cell(entry.default)} | {cell(linked(entry.description))} |"
            for entry in entries
        ]
        table = "\n".join(["| variable | flag | default | meaning |", "|---|---|---|---|", *rows])
        about = linked(readable(group.about, settings=settings))
        parts.append(f"## {group.title}\n\n{about}\n\n{table}")
    parts.append(PAGE_END)
    return "\n\n".join(parts)


def with_generated_settings(page: str, settings: type[Settings] = Settings) -> str:
    """The page with its generated part (between the two markers) written anew."""
    start, end = page.find(PAGE_START), page.find(PAGE_END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no generated part: it needs {PAGE_START} and {PAGE_END}")
    return page[:start] + configuration_block(settings) + page[end + len(PAGE_END) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nograd.settings_reference",
        description="Write the settings part of the configuration page from nograd/settings.py.",
    )
    parser.add_argument("page", type=Path, help="the page, e.g. docs/configuration.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is not current")
    options = parser.parse_args(argv)
    problems = grouping_problems()
    for problem in problems:
        print(problem, file=sys.stderr)
    current = options.page.read_text()
    wanted = with_generated_settings(current)
    if options.check:
        if wanted != current:
            print(f"{options.page} is not current: run without --check", file=sys.stderr)
        return 1 if problems or wanted != current else 0
    options.page.write_text(wanted)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
