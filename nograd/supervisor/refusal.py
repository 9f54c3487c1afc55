"""Answering the connections the supervisor accepted and no worker can take.

A connection the supervisor accepted is the server's: closing it unanswered cuts a request its
client already sent. When no worker can take one (none serving, every inbox full), an HTTP
client gets ``503`` with ``Retry-After`` and ``Connection: close`` from the supervisor itself. The
request is left unread, and closing a socket with unread bytes resets it, which can destroy the
answer before the client reads it; so the supervisor ends its side of the connection and reads
(and drops) what the client sends until the client closes, or ``LINGER_S`` passed (a lingering
close). A gRPC connection is closed at once: its client retries on a new one.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Final

from nograd.serving.errors import RETRY_AFTER_S
from nograd.supervisor.handoff import HTTP

logger = logging.getLogger(__name__)

LINGER_S: Final = 2.0
"""How long an answered connection waits for its client to close before it is closed anyway."""
_BODY: Final = b'{"error":"no worker can take the connection; retry later"}'
SERVICE_UNAVAILABLE: Final = b"".join(
    [
        b"HTTP/1.1 503 Service Unavailable\r\n",
        b"content-type: application/json\r\n",
        b"retry-after: %d\r\n" % RETRY_AFTER_S,
        b"content-length: %d\r\n" % len(_BODY),
        b"connection: close\r\n\r\n",
        _BODY,
    ]
)


class Refusals:
    """The connections answered and not yet closed, each with the time it is closed anyway."""

    def __init__(self) -> None:
        self._lingering: dict[socket.socket, float] = {}
        self.count = 0
        """Connections refused so far."""

    def refuse(self, conn: socket.socket, front: bytes) -> None:
        """Answer ``conn``, which is this object's to close from now on."""
        self.count += 1
        answer = "answered it 503" if front == HTTP else "closed it"
        logger.warning("no worker could take a connection; %s (%d so far)", answer, self.count)
        if front != HTTP:
            conn.close()
            return
        try:
            conn.setblocking(False)
            conn.send(SERVICE_UNAVAILABLE)  # a few hundred bytes: an empty buffer takes them
            conn.shutdown(socket.SHUT_WR)
        except OSError:  # the client is gone
            conn.close()
            return
        self._lingering[conn] = time.monotonic() + LINGER_S

    @property
    def sockets(self) -> list[socket.socket]:
        """The answered connections, to wait on for their client's bytes or close."""
        return list(self._lingering)

    @property
    def deadlines(self) -> list[float]:
        """When each answered connection is closed anyway."""
        return list(self._lingering.values())

    def read(self) -> None:
        """Drop what each client sent; close the connections whose client closed or whose
        time is up."""
        now = time.monotonic()
        for conn, deadline in list(self._lingering.items()):
            if not self._client_done(conn) and now < deadline:
                continue
            del self._lingering[conn]
            conn.close()

    def close(self) -> None:
        for conn in self._lingering:
            conn.close()
        self._lingering.clear()

    @staticmethod
    def _client_done(conn: socket.socket) -> bool:
        while True:
            try:
                if not conn.recv(65536):
                    return True
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                return True
