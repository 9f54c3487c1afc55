"""Triton's log settings (its logging extension) over nograd's loggers: each level switched on or
off on its own (``log_info``, ``log_warning``, ``log_error``; debug lines with a verbose level
above 0) and the line format, changed while the server runs.

Python's levels are thresholds, Triton's are switches: the root logger's level lets through the
lowest level switched on, and a filter on the root's handlers drops the levels switched off. The
log file is where the server was started to write (standard error); like Triton's newer
versions, nograd refuses to move it over the network.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Final

from nograd.observability.logs import JsonFormatter, TextFormatter, pin_transport_loggers
from nograd.observability.trace_settings import BadSetting, FixedSetting

FORMATS: Final = ("text", "json")
NAMES: Final = (
    "log_file",
    "log_info",
    "log_warning",
    "log_error",
    "log_verbose_level",
    "log_format",
)
UINT32_MAX: Final = 2**32 - 1


class LevelSwitches(logging.Filter):
    """Drops the records of the levels switched off; debug passes when the verbose level is
    above 0."""

    def __init__(self) -> None:
        super().__init__()
        self.info = True
        self.warning = True
        self.error = True
        self.verbose = 0

    def filter(self, record: logging.LogRecord) -> bool:
        level = record.levelno
        if level >= logging.ERROR:
            return self.error
        if level >= logging.WARNING:
            return self.warning
        if level >= logging.INFO:
            return self.info
        return self.verbose > 0


class LogSettings:
    """The process's log switches and format, read from and applied to its root logger."""

    def __init__(self, log_format: str) -> None:
        self.switches = LevelSwitches()
        self.log_format = log_format
        root = logging.getLogger()
        level = root.getEffectiveLevel()
        self.switches.verbose = 1 if level <= logging.DEBUG else 0
        self.switches.info = level <= logging.INFO
        self.switches.warning = level <= logging.WARNING
        self.switches.error = level <= logging.ERROR
        pin_transport_loggers()  # a verbose level asked for never lets them log headers

    def document(self) -> dict[str, object]:
        """The settings as Triton answers them (``log_file`` empty: standard error)."""
        return {
            "log_file": "",
            "log_info": self.switches.info,
            "log_warning": self.switches.warning,
            "log_error": self.switches.error,
            "log_verbose_level": self.switches.verbose,
            "log_format": self.log_format,
        }

    def update(self, changes: Mapping[str, object]) -> None:
        """Check every change, then apply them all; a bad one changes nothing."""
        switches: dict[str, object] = {}
        for name, given in changes.items():
            if name not in NAMES:
                raise BadSetting(
                    f"unknown log setting '{str(name)[:64]}': expected one of {', '.join(NAMES)}"
                )
            if given is None:
                continue  # Triton's: a null value leaves the setting as it is
            if name == "log_file":
                raise FixedSetting("log file location can not be updated through network protocol")
            if name == "log_verbose_level":
                if isinstance(given, bool) or not isinstance(given, int):
                    raise BadSetting(
                        f"'log_verbose_level' must be an unsigned integer, got: {given!r:.64}"
                    )
                if not 0 <= given <= UINT32_MAX:
                    raise BadSetting(
                        f"'log_verbose_level' must be an unsigned integer, got: {given}"
                    )
            elif name == "log_format":
                if given not in FORMATS:
                    raise BadSetting(
                        f"invalid argument for --log_format, got: {str(given)[:64]} "
                        f"(nograd's formats: {', '.join(FORMATS)})"
                    )
            elif not isinstance(given, bool):
                raise BadSetting(f"'{name}' must be a boolean, got: {given!r:.64}")
            switches[name] = given
        self._apply(switches)

    def _apply(self, changes: Mapping[str, object]) -> None:
        switches = self.switches
        switches.info = bool(changes.get("log_info", switches.info))
        switches.warning = bool(changes.get("log_warning", switches.warning))
        switches.error = bool(changes.get("log_error", switches.error))
        verbose = changes.get("log_verbose_level", switches.verbose)
        switches.verbose = verbose if isinstance(verbose, int) else switches.verbose
        root = logging.getLogger()
        if switches.verbose > 0:
            root.setLevel(logging.DEBUG)
        elif switches.info:
            root.setLevel(logging.INFO)
        elif switches.warning:
            root.setLevel(logging.WARNING)
        else:
            root.setLevel(logging.ERROR)
        log_format = changes.get("log_format")
        if isinstance(log_format, str):
            self.log_format = log_format
        formatter = JsonFormatter() if self.log_format == "json" else TextFormatter()
        for handler in root.handlers:
            if switches not in handler.filters:
                handler.addFilter(switches)
            if isinstance(log_format, str) and isinstance(
                handler.formatter, JsonFormatter | TextFormatter
            ):
                handler.setFormatter(formatter)
