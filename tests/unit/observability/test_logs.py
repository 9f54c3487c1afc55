"""nograd/observability/logs.py: one JSON object per line, fixed fields and extras; uvicorn goes
through it."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from nograd.observability.log_settings import LogSettings
from nograd.observability.logs import LOG_FORMAT_ENV, resolve_format, setup_logging


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """setup_logging changes process-wide state; put it back so other tests see pytest's set-up."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    named = ["uvicorn", "uvicorn.error", "uvicorn.access", "httpcore"]
    saved_named = {
        name: (list(logging.getLogger(name).handlers), logging.getLogger(name).propagate)
        for name in named
    }
    saved_named_levels = {name: logging.getLogger(name).level for name in named}
    yield
    root.handlers[:] = saved_handlers
    root.setLevel(saved_level)
    for name, (handlers, propagate) in saved_named.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.propagate = propagate
        logger.setLevel(saved_named_levels[name])
    logging.captureWarnings(False)


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_line_has_fixed_fields_and_extras() -> None:
    stream = io.StringIO()
    setup_logging("info", "json", stream)
    logging.getLogger("nograd.test").info(
        "batch of %d rows", 8, extra={"model": "digits", "request_id": "abc-1"}
    )
    (line,) = _lines(stream)
    assert line["level"] == "info"
    assert line["logger"] == "nograd.test"
    assert line["message"] == "batch of 8 rows"
    assert line["model"] == "digits"
    assert line["request_id"] == "abc-1"
    # ISO 8601 in UTC with milliseconds, so lines from many pods sort as text.
    assert line["timestamp"].endswith("+00:00")
    assert "." in line["timestamp"]


def test_multiline_message_and_traceback_stay_in_one_line() -> None:
    stream = io.StringIO()
    setup_logging("info", "json", stream)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("nograd.test").exception("table:\nrow 1\nrow 2")
    (line,) = _lines(stream)
    assert line["message"] == "table:\nrow 1\nrow 2"
    assert line["level"] == "error"
    assert "RuntimeError: boom" in line["exception"]


def test_unserialisable_extra_does_not_lose_the_line() -> None:
    stream = io.StringIO()
    setup_logging("info", "json", stream)
    logging.getLogger("nograd.test").info("odd", extra={"device": object(), "huge": 2**70})
    (line,) = _lines(stream)
    assert line["message"] == "odd"
    assert line["huge"] == str(2**70)


def test_extras_cannot_overwrite_fixed_fields() -> None:
    stream = io.StringIO()
    setup_logging("info", "json", stream)
    logging.getLogger("nograd.test").info("real", extra={"level": "fake", "timestamp": "fake"})
    (line,) = _lines(stream)
    assert line["level"] == "info"
    assert line["timestamp"] != "fake"


def test_level_filters_debug() -> None:
    stream = io.StringIO()
    setup_logging("info", "json", stream)
    logging.getLogger("nograd.test").debug("hidden")
    logging.getLogger("nograd.test").warning("shown")
    assert [line["message"] for line in _lines(stream)] == ["shown"]
    setup_logging("debug", "json", stream)
    logging.getLogger("nograd.test").debug("now shown")
    assert _lines(stream)[-1]["message"] == "now shown"
    # Connection-pool chatter stays out even at debug.
    logging.getLogger("httpcore").debug("connect_tcp.started")
    assert _lines(stream)[-1]["message"] == "now shown"


def test_uvicorn_loggers_go_through_the_same_formatter() -> None:
    stream = io.StringIO()
    # uvicorn's default config would have attached its own handler; setup must detach it.
    logging.getLogger("uvicorn.error").addHandler(logging.StreamHandler(io.StringIO()))
    logging.getLogger("uvicorn.error").propagate = False
    setup_logging("info", "json", stream)
    logging.getLogger("uvicorn.error").info(
        "Started server process [%d]", 42, extra={"color_message": "\x1b[36m%d\x1b[0m"}
    )
    (line,) = _lines(stream)
    assert line["logger"] == "uvicorn.error"
    assert line["message"] == "Started server process [42]"
    assert "color_message" not in line


def test_warnings_are_logged_as_json() -> None:
    import warnings

    stream = io.StringIO()
    setup_logging("info", "json", stream)
    warnings.warn("deprecated knob", UserWarning, stacklevel=1)
    (line,) = _lines(stream)
    assert line["logger"] == "py.warnings"
    assert "deprecated knob" in line["message"]


def test_setup_twice_keeps_one_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    setup_logging("info", "json", first)
    setup_logging("info", "json", second)
    logging.getLogger("nograd.test").info("once")
    assert first.getvalue() == ""
    assert len(_lines(second)) == 1


def test_text_format_appends_extras() -> None:
    stream = io.StringIO()
    setup_logging("info", "text", stream)
    logging.getLogger("nograd.test").info("loaded", extra={"model": "digits"})
    text = stream.getvalue()
    assert "INFO nograd.test: loaded [model=digits]" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_text_on_a_terminal_and_json_otherwise_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOG_FORMAT_ENV, raising=False)
    assert resolve_format(None, Terminal()) == "text"
    assert resolve_format(None, io.StringIO()) == "json"
    assert resolve_format("json", Terminal()) == "json"
    terminal = Terminal()
    setup_logging("info", None, terminal)
    logging.getLogger("nograd.test").info("read by a person")
    assert "INFO nograd.test: read by a person" in terminal.getvalue()
    monkeypatch.setenv(LOG_FORMAT_ENV, "json")
    assert resolve_format(None, Terminal()) == "json"


def test_format_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOG_FORMAT_ENV, raising=False)
    assert resolve_format(None) == "json"
    monkeypatch.setenv(LOG_FORMAT_ENV, "TEXT")
    assert resolve_format(None) == "text"
    assert resolve_format("json") == "json"  # an explicit argument wins over the environment
    monkeypatch.setenv(LOG_FORMAT_ENV, "xml")
    with pytest.raises(ValueError, match="'xml'"):
        resolve_format(None)


def test_bad_level_is_named() -> None:
    with pytest.raises(ValueError, match="'loud'"):
        setup_logging("loud", "json", io.StringIO())


KEY = "s3cret-key-0123"


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_credentials_are_redacted_from_every_line(log_format: str) -> None:
    """Whatever a line carries (a header logged by a library, an extra, an exception), no
    credential reaches the log: header values, schemes' tokens and configured keys."""
    stream = io.StringIO()
    setup_logging("debug", log_format, stream, keys=["other-key", KEY, "ab"])
    log = logging.getLogger("nograd.test")
    log.debug("Decoded (b'authorization', b'Bearer %s'), consumed 1", KEY)
    log.info("headers %s", {"Authorization": "Basic dXNlcjpwYXNz", "x-api-key": "zz-9"})
    log.info("got it", extra={"token": KEY})
    try:
        raise ValueError(f"bad key {KEY}")
    except ValueError:
        log.exception("failed")
    text = stream.getvalue()
    for secret in (KEY, "dXNlcjpwYXNz", "zz-9"):
        assert secret not in text, text
    assert text.count("[redacted]") >= 5
    assert "ab" in text  # too short to look for everywhere: ordinary text stays readable


def test_transport_loggers_stay_at_warning_whatever_the_level() -> None:
    """hpack logs every decoded header, ``authorization`` included, at debug level."""
    stream = io.StringIO()
    setup_logging("debug", "json", stream)
    for name in ("hpack.hpack", "hpack.table", "h11", "httpcore.http11", "uvicorn.asgi"):
        logging.getLogger(name).debug("Decoded (b'authorization', b'Bearer %s')", KEY)
        assert not logging.getLogger(name).isEnabledFor(logging.INFO)
    LogSettings("json").update({"log_verbose_level": 1})  # Triton's logging extension
    logging.getLogger("hpack.hpack").debug("Decoded %s", KEY)
    assert stream.getvalue() == ""
