"""Triton's trace settings (its trace extension): one global setting and, per model, a setting
whose unspecified fields follow the global one, each answered in Triton's shape.

Values arrive as Triton's clients send them (strings, the level a list of strings; ``None``
clears a model's field so it follows the global one again) and are checked before anything
changes: an unknown name, a level nograd does not trace, a count or rate out of range is refused
naming it, never ignored. The trace file and mode are fixed at start-up, as in Triton.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Final


class BadSetting(ValueError):
    """A setting a client sent that is refused; the message is Triton's where it has one."""


class FixedSetting(BadSetting):
    """A setting fixed at start-up that a client tried to change."""


FIELDS: Final = ("trace_level", "trace_rate", "trace_count", "log_frequency")
"""The settings a client may change."""
FIXED: Final = ("trace_file", "trace_mode")
"""Settings reported but fixed at start-up (``NOGRAD_TRACE_FILE``, ``NOGRAD_TRACE_MODE``)."""
UINT32_MAX: Final = 2**32 - 1
INT32_MAX: Final = 2**31 - 1
LEVELS: Final = ("OFF", "TIMESTAMPS")

Value = str | int | list[str] | None


@dataclass(frozen=True)
class TraceSetting:
    """One setting's values, and which of them were set for it (a model's others follow the
    global setting)."""

    level: str = "OFF"
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0
    specified: frozenset[str] = field(default_factory=frozenset)

    def value(self, name: str) -> int | str:
        values: dict[str, int | str] = {
            "trace_level": self.level,
            "trace_rate": self.rate,
            "trace_count": self.count,
            "log_frequency": self.log_frequency,
        }
        return values[name]

    def with_values(self, values: Mapping[str, int | str]) -> TraceSetting:
        return replace(
            self,
            level=str(values.get("trace_level", self.level)),
            rate=int(values.get("trace_rate", self.rate)),
            count=int(values.get("trace_count", self.count)),
            log_frequency=int(values.get("log_frequency", self.log_frequency)),
        )

    @property
    def on(self) -> bool:
        return self.level != "OFF"


def _number(name: str, given: str | int, low: int, high: int) -> int:
    text = str(given).strip()
    try:
        number = int(text)
    except ValueError:
        raise BadSetting(f"Unable to parse '{name}', got: {text[:64]}") from None
    if not low <= number <= high:
        raise BadSetting(
            f"Unable to parse '{name}', value is out of range [ {low}, {high} ], got: {text[:64]}"
        )
    return number


def _level(given: str | int | list[str]) -> str:
    levels = given if isinstance(given, list) else [str(given)]
    for level in levels:
        if level == "TENSORS":
            raise BadSetting(
                "trace level 'TENSORS' is not supported: nograd traces 'TIMESTAMPS' only"
            )
        if level not in LEVELS:
            raise BadSetting(
                f"Unable to parse 'trace_level', got: {str(level)[:64]} "
                "(expected 'OFF' or 'TIMESTAMPS')"
            )
    if "OFF" in levels and len(levels) > 1:
        raise BadSetting("Expect only one trace level 'OFF' is specified")
    return "OFF" if not levels or "OFF" in levels else "TIMESTAMPS"


def parse_update(changes: Mapping[str, Value]) -> tuple[dict[str, int | str], set[str]]:
    """A client's changes as (values to set, fields to clear); refused whole when any is bad."""
    values: dict[str, int | str] = {}
    cleared: set[str] = set()
    for name, given in changes.items():
        if name in FIXED:
            what = "trace file location" if name == "trace_file" else "trace mode"
            raise FixedSetting(f"{what} can not be updated through network protocol")
        if name not in FIELDS:
            raise BadSetting(
                f"unknown trace setting '{str(name)[:64]}': expected one of {', '.join(FIELDS)}"
            )
        if given is None or given == []:
            cleared.add(name)
        elif name == "trace_level":
            values[name] = _level(given)
        elif isinstance(given, list):
            raise BadSetting(f"Unable to parse '{name}', got a list: {given!r:.64}")
        elif name == "trace_count":
            values[name] = _number(name, given, -1, INT32_MAX)
        else:
            values[name] = _number(name, given, 0, UINT32_MAX)
    return values, cleared


class TraceSettings:
    """The global trace setting and each model's, with Triton's fallback between them."""

    def __init__(self, initial: TraceSetting) -> None:
        self._default = initial
        self.global_setting = initial
        self._models: dict[str, TraceSetting] = {}

    def of(self, model: str | None) -> TraceSetting:
        """The setting in force for ``model`` (None: the global one)."""
        if model is None:
            return self.global_setting
        return self._models.get(model, self.global_setting)

    @property
    def models(self) -> Mapping[str, TraceSetting]:
        return self._models

    def update(self, model: str | None, changes: Mapping[str, Value]) -> None:
        """Apply ``changes`` to the global setting or ``model``'s; a cleared global field goes
        back to its start-up value, a cleared model field follows the global one."""
        values, cleared = parse_update(changes)
        if model is None:
            current = self.global_setting
            reset = {name: self._default.value(name) for name in cleared}
            specified = (current.specified | values.keys()) - cleared
            self.global_setting = replace(
                current.with_values(reset).with_values(values), specified=frozenset(specified)
            )
            self._models = {name: self._follow(s) for name, s in self._models.items()}
            return
        current = self._models.get(model, TraceSetting())
        specified = (current.specified | values.keys()) - cleared
        if not specified:
            self._models.pop(model, None)
            return
        kept = {name: current.value(name) for name in specified - values.keys()}
        self._models[model] = self._follow(
            TraceSetting(specified=frozenset(specified)).with_values(kept | values)
        )

    def _follow(self, setting: TraceSetting) -> TraceSetting:
        """A model's setting with its unspecified fields taken from the global one."""
        inherited = {
            name: self.global_setting.value(name)
            for name in FIELDS
            if name not in setting.specified
        }
        return setting.with_values(inherited)


def document(setting: TraceSetting, mode: str, trace_file: str, url: str) -> dict[str, object]:
    """A setting as Triton answers it: numbers as strings, the level as a list; the file and
    log frequency in the triton mode, the collector's url in the opentelemetry mode."""
    answer: dict[str, object] = {
        "trace_level": [setting.level],
        "trace_rate": str(setting.rate),
        "trace_count": str(setting.count),
    }
    if mode == "triton":
        answer["log_frequency"] = str(setting.log_frequency)
        answer["trace_file"] = trace_file
    answer["trace_mode"] = mode
    if mode == "opentelemetry":
        answer["url"] = url
    return answer
