"""Logging set-up: one JSON object per line, or plain text; by default text on a terminal.

Why JSON: in a container the log is a stream that a shipper (Loki, Fluent Bit, Cloud Logging) parses
line by line. One object per line keeps multi-line messages (the startup memory-plan table, a
traceback) in one record, and fields passed with ``extra=`` (``model``, ``request_id``, ``rows``…)
stay queryable instead of being buried in the message text.

Every logger goes through the root logger's single handler, uvicorn's included: ``server.py`` runs
uvicorn with ``log_config=None`` so uvicorn installs no handlers of its own, and this module makes
uvicorn's loggers propagate to the root.

Credentials never reach the log, whatever the level: the transport libraries that log headers
(hpack decodes every gRPC call's ``authorization``) are pinned at WARNING, and the handler
redacts what looks like a credential (an ``Authorization`` or ``X-API-Key`` value, a ``Bearer``
token, any configured key) from every line it writes.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Final, TextIO, cast, get_args

import orjson

from nograd.observability.library_logs import quiet_libraries
from nograd.observability.log_tables import (
    TABLE_FIELD,
    field_label,
    field_text,
    table_rows,
    text_table,
)
from nograd.settings import LogFormat

LOG_FORMATS: Final[tuple[str, ...]] = get_args(LogFormat)
LOG_FORMAT_ENV: Final = "NOGRAD_LOG_FORMAT"
"""Read when the caller passes no format (tools that set up logging without building Settings);
the server passes ``Settings.log_format``, which reads the same variable."""

# Attributes every LogRecord carries; anything else on a record came from ``extra=``.
_RECORD_ATTRIBUTES: Final = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None))
) | {"message", "asctime", "taskName", "color_message"}
# ``color_message`` is uvicorn's ANSI-coloured duplicate of its message: noise in a log shipper.
_FIXED_FIELDS: Final = ("timestamp", "level", "logger", "message")
"""The fields of every JSON line, which neither an extra nor a table's row may overwrite."""

# Libraries that are chatty at debug level about things an operator of nograd never needs
# (HTTP connection pools, multipart parsing, file locks of the hub cache).
_CHATTY_LOGGERS: Final = ("httpcore", "httpx", "urllib3", "filelock", "multipart", "asyncio")
_UVICORN_LOGGERS: Final = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
TRANSPORT_LOGGERS: Final = (
    "hpack",
    "h2",
    "h11",
    "httptools",
    "httpcore",
    "httpx",
    "urllib3",
    "multipart",
    "python_multipart",
    "websockets",
    "uvicorn.asgi",
)
"""Libraries that log requests' headers (and so credentials) at debug level: hpack decodes each
gRPC call's headers, ``uvicorn.asgi`` prints whole ASGI messages. Pinned at WARNING whatever level
the server or the logging extension asks for."""
REDACTED: Final = "[redacted]"
_CREDENTIAL_FIELD: Final = re.compile(
    r"(?i)((?:proxy-)?authorization|x-api-key|api[-_]?key|cookie|set-cookie)"
    r"((?:\\?['\"])?\s*[:=,]\s*(?:b?\\?['\"])?)"
    r"((?:bearer|basic|token)\s+)?[^\s'\"\\,;}\])]+"
)
"""A header or field that carries a credential, and its value (quoted, a bytes repr, JSON)."""
_BEARER: Final = re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=:\-]+")
"""A credential after its scheme, wherever it appears."""
_CREDENTIAL_WORDS: Final = (
    "authorization",
    "api-key",
    "api_key",
    "apikey",
    "cookie",
    "bearer",
    "basic",
)
"""What a line must hold, any case, for the patterns above to be worth running: most lines hold
none, and a substring test costs a fraction of a pattern's search."""
SHORTEST_REDACTED_KEY: Final = 4
"""Configured keys shorter than this are not searched for in every line (they would match
ordinary words); the header and scheme patterns still catch them where they are sent."""


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a caller attached with ``extra=``, in the order they were set."""
    return {
        key: value
        for key, value in record.__dict__.items()
        if key not in _RECORD_ATTRIBUTES and not key.startswith("_")
    }


def _timestamp(record: logging.LogRecord) -> str:
    # UTC with an explicit offset and milliseconds: sortable, and unambiguous across pods in
    # different time zones.
    created = datetime.fromtimestamp(record.created, tz=UTC)
    return created.isoformat(timespec="milliseconds")


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object: timestamp, level, logger, message, then extras."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "timestamp": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _extras(record).items():
            # An extra may not overwrite the four fixed fields a shipper indexes on.
            document.setdefault(key, value)
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        rows = table_rows(document)
        if rows is None:
            return _dumps(document)
        # A table: one object per row, each with the record's fields and the row's own.
        del document[TABLE_FIELD]
        if not rows:
            return _dumps(document)
        return "\n".join(
            _dumps({**document, **{k: v for k, v in row.items() if k not in _FIXED_FIELDS}})
            for row in rows
        )


def _dumps(document: dict[str, Any]) -> str:
    try:
        return orjson.dumps(document, default=str).decode()
    except TypeError:
        # orjson refuses a few values outright (ints over 64 bits, non-str keys): never lose
        # a log line to its payload.
        return orjson.dumps({str(key): str(value) for key, value in document.items()}).decode()


class TextFormatter(logging.Formatter):
    """Human-readable lines for a terminal; extras are appended as ``key=value``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = _extras(record)
        rows = table_rows(extras)
        if rows is not None:
            del extras[TABLE_FIELD]
        if not extras and not rows:
            return line
        first, newline, rest = line.partition("\n")
        if extras:
            pairs = " ".join(f"{field_label(k)}={field_text(k, v)}" for k, v in extras.items())
            first = f"{first} [{pairs}]"
        if rows:
            # A table: aligned under its message, before a traceback if there is one.
            first = "\n".join([first, *(f"    {row}" for row in text_table(rows))])
        return f"{first}{newline}{rest}"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def redact(line: str, keys: Iterable[str] = ()) -> str:
    """``line`` with every credential in it replaced by ``[redacted]``: the values of
    credential headers and fields, ``Bearer``/``Basic`` tokens, and each of ``keys`` (as
    written, and as JSON escapes it)."""
    for key in keys:
        if key in line:
            line = line.replace(key, REDACTED)
    lowered = line.lower()
    if not any(word in lowered for word in _CREDENTIAL_WORDS):
        return line
    line = _CREDENTIAL_FIELD.sub(lambda found: f"{found[1]}{found[2]}{REDACTED}", line)
    return _BEARER.sub(lambda found: f"{found[1]}{found[2]}{REDACTED}", line)


def pin_transport_loggers() -> None:
    """Hold the loggers that print headers at WARNING (``TRANSPORT_LOGGERS``), so no log level
    asked for by settings or over the network makes them print a credential."""
    for name in TRANSPORT_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


class _NogradHandler(logging.StreamHandler[TextIO]):
    """The one handler of the root logger: every line it writes is redacted (``redact``),
    whichever formatter the logging extension has set. A second set-up replaces it, not
    doubles it."""

    def __init__(self, stream: TextIO, keys: Iterable[str]) -> None:
        super().__init__(stream)
        forms: set[str] = set()
        for key in keys:
            if len(key) >= SHORTEST_REDACTED_KEY:
                forms.add(key)
                forms.add(orjson.dumps(key).decode()[1:-1])  # as it appears in a JSON line
        # Longest first, so a key that contains another is replaced whole.
        self._keys = tuple(sorted(forms, key=len, reverse=True))

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record), self._keys)


def resolve_format(log_format: str | None, stream: TextIO | None = None) -> LogFormat:
    """The format to use: the argument, else ``NOGRAD_LOG_FORMAT``, else text when ``stream``
    is a terminal (a person reads it) and JSON otherwise (a log shipper does)."""
    value = log_format or os.environ.get(LOG_FORMAT_ENV)
    if not value:
        return "text" if stream is not None and _is_terminal(stream) else "json"
    value = value.strip().lower()
    if value not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}; got {value!r}")
    return cast(LogFormat, value)


def setup_logging(
    level: str,
    log_format: str | None = None,
    stream: TextIO | None = None,
    keys: Iterable[str] = (),
) -> logging.Handler:
    """Route every logger (nograd's, uvicorn's, warnings) through one handler on the root logger.

    ``level`` is a Settings log level (``info``, ``debug``…); ``log_format`` is ``json`` or
    ``text`` (``None``: ``NOGRAD_LOG_FORMAT``, else text on a terminal and JSON otherwise). Safe
    to call again: the previous nograd handler is replaced. ``keys``: the configured API keys,
    redacted wherever they appear. Returns the handler, which tests read back.
    """
    stream = stream if stream is not None else sys.stderr
    formatter: logging.Formatter = (
        JsonFormatter() if resolve_format(log_format, stream) == "json" else TextFormatter()
    )
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"log_level must be a logging level name; got {level!r}")

    handler = _NogradHandler(stream, keys)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _NogradHandler)]:
        # StreamHandler.close() leaves the stream open: stderr stays usable.
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric_level)

    # uvicorn's loggers must reach the root handler rather than print through their own.
    for name in _UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(max(numeric_level, logging.INFO))
    pin_transport_loggers()
    # torch and friends warn through the warnings module; make those JSON lines too.
    logging.captureWarnings(True)
    # Libraries' INFO chatter and warnings stay out unless the level is debug.
    quiet_libraries(numeric_level)
    return handler
