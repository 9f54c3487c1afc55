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
    from nograd.observability.library_logs import LIBRARY_LOGGERS, MISSING_EXTRAS_LOGGERS

    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    named = [
        "uvicorn",
        "uvicorn.error",
        "uvicorn.access",
        "httpcore",
        *LIBRARY_LOGGERS,
        *MISSING_EXTRAS_LOGGERS,
    ]
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


PLAN_ROWS = [
    {"model": "digits", "engine": "onnx", "limit": 64, "weights_bytes": 3 * 2**20},
    {"model": "minilm", "engine": "onnx<=4,eager", "limit": 4096, "weights_bytes": 1536},
]


def test_a_table_is_one_json_object_per_row() -> None:
    """A shipper reads each row's columns as fields, not one message of escaped newlines."""
    stream = io.StringIO()
    setup_logging("info", "json", stream)
    rows = [*PLAN_ROWS, {"model": "odd", "level": "fake", "message": "fake"}]
    logging.getLogger("nograd.test").info(
        "memory plan for %s", "cpu", extra={"budget_bytes": 2**30, "table": rows}
    )
    lines = _lines(stream)
    assert len(lines) == 3
    for line, row in zip(lines, rows, strict=True):
        assert (line["level"], line["logger"]) == ("info", "nograd.test")
        assert line["message"] == "memory plan for cpu" and "\n" not in line["message"]
        assert line["budget_bytes"] == 2**30  # the record's own fields on every row
        assert "table" not in line
        assert line["model"] == row["model"]
    assert lines[0]["limit"] == 64 and lines[0]["weights_bytes"] == 3 * 2**20
    assert lines[1]["engine"] == "onnx<=4,eager"
    # A row may not overwrite the fixed fields either.
    assert lines[2]["level"] == "info" and lines[2]["message"] == "memory plan for cpu"
    assert len({line["timestamp"] for line in lines}) == 1  # one record


def test_an_empty_table_is_the_record_alone() -> None:
    stream = io.StringIO()
    setup_logging("info", "json", stream)
    logging.getLogger("nograd.test").info("nothing served", extra={"table": []})
    (line,) = _lines(stream)
    assert line["message"] == "nothing served" and "table" not in line


def test_a_table_in_text_is_aligned_under_its_message() -> None:
    stream = io.StringIO()
    setup_logging("info", "text", stream)
    logging.getLogger("nograd.test").info(
        "memory plan for cpu", extra={"budget_bytes": 2**30, "load_s": 1.5, "table": PLAN_ROWS}
    )
    first, header, rule, digits, minilm = stream.getvalue().splitlines()
    # Sizes and seconds as people read them, named without their unit.
    assert first.endswith("INFO nograd.test: memory plan for cpu [budget=1.0 GiB load=1.50s]")
    assert header.split() == ["model", "engine", "limit", "weights"]
    assert set(rule.strip()) == {"-", " "}
    assert digits.split() == ["digits", "onnx", "64", "3.0", "MiB"]
    assert minilm.split() == ["minilm", "onnx<=4,eager", "4096", "1.5", "KiB"]
    # Text columns left-aligned, numbers right-aligned.
    assert digits.index("onnx") == minilm.index("onnx<=4")
    assert digits.index("64") + 2 == minilm.index("4096") + 4
    assert digits.endswith("3.0 MiB") and minilm.endswith("1.5 KiB")


def test_libraries_info_lines_stay_out_unless_debug() -> None:
    stream = io.StringIO()
    setup_logging("info", "json", stream)
    folding = logging.getLogger("onnxscript.optimizer._constant_folding")
    folding.info("Skipping constant folding for node 'node_Shape_0'")
    logging.getLogger("onnx_ir.passes.common.unused_removal").info("No unused functions")
    logging.getLogger("torch.onnx._internal.exporter._registration").warning(
        "torchvision is not installed. Skipping torchvision::nms"
    )
    folding.warning("a library's warning still shows")
    logging.getLogger("nograd.test").info("nograd's own")
    assert [line["message"] for line in _lines(stream)] == [
        "a library's warning still shows",
        "nograd's own",
    ]
    setup_logging("debug", "json", stream)
    folding.info("shown at debug")
    assert _lines(stream)[-1]["message"] == "shown at debug"


def test_libraries_warnings_are_debug_lines_and_nograds_own_are_warnings() -> None:
    import copyreg
    import warnings

    stream = io.StringIO()
    setup_logging("info", "json", stream)
    # Raised in a library (here the standard library), as torch's FutureWarnings are.
    warnings.warn_explicit("LeafSpec is deprecated", FutureWarning, copyreg.__file__, 105)
    assert _lines(stream) == []
    # Raised in nograd's own code: a warning line, with where it came from.
    warnings.warn_explicit("a knob is deprecated", UserWarning, logging_file(), 7)
    (line,) = _lines(stream)
    assert line["level"] == "warning" and line["logger"] == "py.warnings"
    assert line["message"] == "UserWarning: a knob is deprecated"
    assert line["category"] == "UserWarning" and line["source"] == f"{logging_file()}:7"
    setup_logging("debug", "json", stream)
    warnings.warn_explicit("LeafSpec is deprecated", FutureWarning, copyreg.__file__, 105)
    line = _lines(stream)[-1]
    assert line["level"] == "debug" and line["message"] == "FutureWarning: LeafSpec is deprecated"


def logging_file() -> str:
    from nograd.observability import logs

    return logs.__file__


def test_library_code_is_told_from_nograd_and_models() -> None:
    import copyreg

    import orjson

    from nograd.observability.library_logs import from_library

    assert from_library(copyreg.__file__) and from_library(orjson.__file__)
    assert from_library("<frozen importlib._bootstrap>")
    assert not from_library(logging_file())
    assert not from_library(__file__)  # a model's or a script's own code


def test_torch_loggers_write_through_nograd_handler() -> None:
    """torch gives its loggers a handler of its own (its own format, not JSON) that stops them
    propagating; routed, they reach the root handler, and TORCH_LOGS's levels stay."""
    import sys

    import torch  # noqa: F401  (route_torch_loggers acts once torch is imported)

    from nograd.observability.library_logs import route_torch_loggers

    own = logging.getLogger("torch._nograd_test")
    torchs = logging.StreamHandler(sys.stderr)
    file_handler = logging.StreamHandler(io.StringIO())
    own.addHandler(torchs)
    own.addHandler(file_handler)
    own.propagate = False
    own.setLevel(logging.INFO)
    try:
        stream = io.StringIO()
        setup_logging("warning", "json", stream)
        route_torch_loggers()
        assert torchs not in own.handlers and file_handler in own.handlers
        own.info("graph break")
        (line,) = _lines(stream)
        assert (line["logger"], line["message"]) == ("torch._nograd_test", "graph break")
    finally:
        own.handlers.clear()
        own.propagate = True
        own.setLevel(logging.NOTSET)


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
