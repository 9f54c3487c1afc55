"""Model names and versions as nograd checks them, and which numbered version folders serve
(Triton's version policy): the rules every source of a name or version (a folder, a config, a
load call) goes through.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_VERSION_RE = re.compile(r"[0-9]{1,18}")


class VersionPolicy(BaseModel):
    """Which of a model's numbered version folders serve (Triton's version policy): the newest
    ``latest`` ones, ``all`` of them, or the ``specific`` ones. Written ``{ latest = 2 }``,
    ``"all"`` or ``{ specific = [1, 3] }``; the newest one alone by default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    latest: int | None = Field(default=None, ge=1)
    specific: tuple[str, ...] | None = None
    all: bool = False

    @model_validator(mode="before")
    @classmethod
    def _from_word(cls, value: object) -> object:
        if value == "all":
            return {"all": True}
        if isinstance(value, str):
            raise ValueError(
                f'must be "all", {{ latest = N }} or {{ specific = [...] }}, got {value!r}'
            )
        return value

    @field_validator("specific", mode="before")
    @classmethod
    def _versions_text(cls, value: object) -> object:
        if isinstance(value, list | tuple):
            return tuple(str(v) for v in value)
        return value

    @field_validator("specific")
    @classmethod
    def _versions_valid(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for version in value or ():
            check_version(version)
        return value

    @model_validator(mode="after")
    def _one_rule(self) -> VersionPolicy:
        rules = [self.latest is not None, self.specific is not None, self.all]
        if sum(rules) > 1:
            raise ValueError("set one of latest, specific or all")
        if self.specific is not None and not self.specific:
            raise ValueError("specific must list at least one version")
        return self

    def select(self, versions: list[str]) -> list[str]:
        """The versions to serve out of those present (numbered folder names), oldest first."""
        ordered = sorted(versions, key=version_order)
        if self.all:
            return ordered
        if self.specific is not None:
            return [v for v in ordered if v in self.specific]
        return ordered[-(self.latest or 1) :]


def version_order(version: str) -> tuple[int, str]:
    """Numbered versions sort by number; anything else after them, by text."""
    return (int(version), "") if is_version(version) else (1 << 62, version)


def is_version(text: str) -> bool:
    """Whether ``text`` is a version: ASCII digits only, at most 18 (a 64-bit number, as Triton's
    versions are). A version names a folder and an engine cache file, so it must never hold a
    path separator, ``..`` or a NUL; ``str.isdigit`` is not enough (it takes ``²``)."""
    return _VERSION_RE.fullmatch(text) is not None


def check_version(version: str) -> str:
    """``version`` unchanged, or a ValueError saying what a version may be."""
    if not is_version(version):
        raise ValueError(f"version {version!r} must be 1 to 18 digits (0-9)")
    return version


def check_model_name(name: str) -> str:
    """``name`` unchanged, or a ValueError saying what a model name may be: it names files (the
    engine cache's) and metric labels, so no separator, no leading dot, bounded length."""
    if _NAME_RE.fullmatch(name) is None:
        raise ValueError(
            f"model name {name!r} must be 1 to 128 letters, digits, '_', '-' or '.', starting "
            "with a letter or digit"
        )
    return name
