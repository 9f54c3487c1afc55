"""A transport that records what is written to it, for the bridge's ends without a socket."""

from __future__ import annotations

from typing import Any

from nograd.bridge.frames import FrameReader


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        pass

    def frames(self) -> list[tuple[int, Any]]:
        """Every frame written so far, in order."""
        return FrameReader().feed(b"".join(self.writes))
