"""The headers of a call's head that nograd reads besides the protocol's own: both processes of
a call read them, the one that serves it (``nograd.http.exchange``) and a front that hands it
over decoded (``nograd.front.decoding``)."""

from __future__ import annotations

from typing import Final

REQUEST_ID_HEADER: Final = "X-Request-ID"
TIMEOUT_HEADER: Final = "X-Request-Timeout"
TRACE_PARENT_HEADER: Final = "traceparent"
