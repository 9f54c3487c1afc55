"""What the libraries nograd runs on may log: their progress chatter kept out unless the log level
is debug, their Python warnings routed through logging, and torch's own log handler replaced by
nograd's.

Why: exporting one model to ONNX logs a hundred INFO lines of ``onnxscript`` and ``onnx_ir``
passes ("No unused functions to remove"); torch warns that torchvision is missing, and libraries
raise FutureWarnings about each other. None of it is the operator's to act on, and it buried
nograd's own account of the start-up. At ``NOGRAD_LOG_LEVEL=debug`` the libraries' INFO lines and
warnings come back, through the same handler and format as nograd's.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import Any, Final, TextIO

LIBRARY_LOGGERS: Final = (
    "onnx_ir",
    "onnxscript",
    "onnx",
    "onnxruntime",
    "transformers",
    "tokenizers",
    "sentence_transformers",
    "huggingface_hub",
    "datasets",
    "fsspec",
    "safetensors",
    "accelerate",
    "torchvision",
    "timm",
    "PIL",
    "numexpr",
    "opentelemetry",
)
"""Libraries that log their own progress at INFO (ONNX export passes, hub downloads, thread
counts): WARNING unless the level is debug, where their INFO lines come back."""
MISSING_EXTRAS_LOGGERS: Final = ("torch.onnx._internal.exporter._registration",)
"""Loggers that warn about optional packages nograd never needs (the ONNX exporter names every
torchvision operator it cannot register without torchvision): ERROR unless the level is debug."""
WARNINGS_LOGGER: Final = "py.warnings"
"""The logger Python warnings go through (``logging.captureWarnings``'s own name)."""

_NOGRAD_DIR: Final = str(Path(__file__).resolve().parents[1])
_TORCH_TRACE_LOGGER: Final = "torch.__trace"
"""torch's structured trace log: written to its own files when asked for, never to the log."""


def quiet_libraries(level: int) -> None:
    """Hold the libraries' loggers at WARNING (``MISSING_EXTRAS_LOGGERS`` at ERROR) for any
    ``level`` above debug; at debug their INFO lines come back. Then route torch's loggers,
    when torch is imported already, and Python's warnings through logging."""
    verbose = level <= logging.DEBUG
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)
    for name in MISSING_EXTRAS_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.ERROR)
    route_torch_loggers()
    route_warnings()


def route_torch_loggers() -> None:
    """Make torch's loggers write through the root logger's handler (nograd's format, JSON or
    text) instead of their own: at import torch gives each of its registered loggers a handler of
    its own that prints to standard error in its own format, and stops them propagating. The
    levels torch set (``TORCH_LOGS``) stay. A no-op before torch is imported, and when called
    again."""
    if "torch" not in sys.modules:
        return
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if (name != "torch" and not name.startswith("torch.")) or name == _TORCH_TRACE_LOGGER:
            continue
        if not isinstance(logger, logging.Logger) or logger.propagate:
            continue
        for handler in list(logger.handlers):
            # torch's own: a plain StreamHandler on standard error (a file asked for through
            # TORCH_LOGS_OUT, or a handler someone else added, stays).
            if type(handler) is logging.StreamHandler and handler.stream in (
                sys.stderr,
                sys.__stderr__,
            ):
                logger.removeHandler(handler)
        logger.propagate = True


def from_library(filename: str) -> bool:
    """Whether a warning was raised in a library's code (the interpreter's standard library or an
    installed package), not nograd's own or a model's."""
    if filename.startswith("<"):  # frozen modules of the standard library, or compiled strings
        return filename.startswith("<frozen")
    path = os.path.realpath(filename)
    if path == _NOGRAD_DIR or path.startswith(_NOGRAD_DIR + os.sep):
        return False
    return any(path.startswith(folder + os.sep) for folder in _library_dirs())


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    folders = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths = sysconfig.get_paths()
    folders.update(paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib"))
    return tuple(os.path.realpath(folder) for folder in folders if folder)


_previous_showwarning = warnings.showwarning


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """A warning as one log record: at WARNING when nograd's or a model's code raised it, at
    DEBUG when a library's did (it shows at ``NOGRAD_LOG_LEVEL=debug``)."""
    if file is not None:  # written to a file its caller chose, as Python writes it
        _previous_showwarning(message, category, filename, lineno, file, line)
        return
    fields: dict[str, Any] = {"category": category.__name__, "source": f"{filename}:{lineno}"}
    level = logging.DEBUG if from_library(filename) else logging.WARNING
    logging.getLogger(WARNINGS_LOGGER).log(
        level, "%s: %s", category.__name__, message, extra=fields
    )


def route_warnings() -> None:
    """Send Python's warnings through logging, one record each (the message, its category and
    where it was raised as fields), instead of printing them to standard error."""
    global _previous_showwarning
    if warnings.showwarning is not _show_warning:
        logging.captureWarnings(True)
        _previous_showwarning = warnings.showwarning
        warnings.showwarning = _show_warning
