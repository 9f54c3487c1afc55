"""The OTLP sink's guard against a collector that is down: the SDK's repeated complaints are
let through once in a while, with a count of those held back."""

from __future__ import annotations

import logging
import time

from nograd.observability.otlp import OnceInAWhile


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("sdk", logging.WARNING, __file__, 1, message, None, None)


def test_a_repeated_message_is_let_through_once_in_a_while() -> None:
    once = OnceInAWhile(interval_s=3600)
    assert once.filter(_record("Queue full, dropping %s."))
    assert not any(once.filter(_record("Queue full, dropping %s.")) for _ in range(99))
    assert once.filter(_record("Failed to export"))  # another message has its own turn
    once._last["Queue full, dropping %s."] = time.monotonic() - 7200  # the interval passed
    again = _record("Queue full, dropping %s.")
    assert once.filter(again)
    assert again.msg == "Queue full, dropping %s. (99 more like it not logged)"
