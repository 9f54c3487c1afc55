"""The sibling worker processes of one server, for model control: a load or unload that reaches
one worker must be applied by all, so every worker answers the same index and no request lands
on a worker that still serves the old model.

Each worker listens on a Unix socket in the folder the workers share (one JSON line in, one out);
a lock file there orders control calls server-wide, and a state file holds what every worker
serves (each model's versions with their overrides), written by the worker that took the call:
its siblings are told to serve it, and a worker started later (a restart after a crash) loads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from nograd.serving.control.repository import Override

logger = logging.getLogger(__name__)

CONTROL_FOLDER = "control"
STATE_FILE = "state.json"
LOCK_FILE = "lock"
SOCKET_SUFFIX = ".sock"
STATE_KEY = "models"
"""The state document's one field: the ``Served`` every worker serves."""
REPLY_TIMEOUT_S = 900.0
"""Longest wait for a sibling to apply a control call: loading and warming up a large model."""

Served = dict[str, dict[str, Override | None]]
"""Models by name, each with its versions and the override each was loaded with."""
Handler = Callable[[dict[str, Any]], Awaitable[str | None]]
"""Applies one control call in this worker; the error, or None when applied."""


class Peers:
    """This worker's end of the control channel between the workers of one server."""

    def __init__(self, shared_dir: Path, apply: Handler) -> None:
        self.directory = shared_dir / CONTROL_FOLDER
        self._apply = apply
        self.routes: dict[str, Handler] = {}
        """Handlers of other parts of the core, by the ``op`` of the calls they take."""
        self._server: asyncio.Server | None = None
        self._path = self.directory / f"{os.getpid()}{SOCKET_SUFFIX}"

    async def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self._path))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self._path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            if not line:
                return
            try:
                call = json.loads(line)
                error = await self.routes.get(str(call.get("op")), self._apply)(call)
            except Exception as exc:
                logger.exception("control call from a sibling worker failed")
                error = f"{type(exc).__name__}: {exc}"
            writer.write(json.dumps({"error": error}).encode() + b"\n")
            await writer.drain()
        finally:
            writer.close()

    async def broadcast(self, call: dict[str, Any]) -> dict[str, str]:
        """Send ``call`` to every sibling and wait until each applied it; the errors by worker
        (process id). A socket no process listens on is a worker that died: skipped."""
        siblings = [
            p for p in self.directory.glob(f"*{SOCKET_SUFFIX}") if p.resolve() != self._path
        ]
        replies = await asyncio.gather(*(self._send(path, call) for path in siblings))
        return {
            f"worker pid {path.name.removesuffix(SOCKET_SUFFIX)}": error
            for path, error in zip(siblings, replies, strict=True)
            if error is not None
        }

    async def _send(self, path: Path, call: dict[str, Any]) -> str | None:
        try:
            reader, writer = await asyncio.open_unix_connection(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # noqa: ASYNC240 (one unlink, no waiting)
            return None
        try:
            writer.write(json.dumps(call).encode() + b"\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), REPLY_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            return f"no answer: {type(exc).__name__}: {exc}"
        finally:
            writer.close()
        if not line:
            return "closed the connection before answering (it may have stopped)"
        error = json.loads(line).get("error")
        return None if error is None else str(error)

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the server-wide control lock: one control call at a time across the workers."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            await asyncio.get_running_loop().run_in_executor(None, fcntl.flock, fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def read_state(self) -> Served | None:
        """What every worker serves, as the last control call recorded it; None before the first
        call, or when it cannot be read (then the start-up set serves)."""
        try:
            document = json.loads((self.directory / STATE_FILE).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            logger.exception("model control state unreadable; using the start-up set")
            return None
        models = document.get(STATE_KEY) if isinstance(document, dict) else None
        if isinstance(models, dict) and all(
            isinstance(versions, dict)
            and all(o is None or isinstance(o, dict) for o in versions.values())
            for versions in models.values()
        ):
            return {str(name): dict(versions) for name, versions in models.items()}
        logger.error("model control state malformed; using the start-up set")
        return None

    def write_state(self, served: Served) -> None:
        path = self.directory / STATE_FILE
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps({STATE_KEY: served}, sort_keys=True))
        temporary.replace(path)
