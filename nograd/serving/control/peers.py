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
Answerer = Callable[[dict[str, Any]], dict[str, Any]]
"""Answers a call that reads this worker's state (and changes nothing) with a JSON document."""


class Peers:
    """This worker's end of the control channel between the workers of one server."""

    def __init__(self, shared_dir: Path, apply: Handler) -> None:
        self.directory = shared_dir / CONTROL_FOLDER
        self._apply = apply
        self.routes: dict[str, Handler] = {}
        """Handlers of other parts of the core, by the ``op`` of the calls they take."""
        self.answers: dict[str, Answerer] = {}
        """Readers of this worker's state, by the ``op`` of the calls they answer (``gather``)."""
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
            reply: dict[str, Any] = {"error": None}
            try:
                call = json.loads(line)
                answerer = self.answers.get(str(call.get("op")))
                if answerer is not None:
                    reply["answer"] = answerer(call)
                else:
                    reply["error"] = await self.routes.get(str(call.get("op")), self._apply)(call)
            except Exception as exc:
                logger.exception("control call from a sibling worker failed")
                reply["error"] = f"{type(exc).__name__}: {exc}"
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        finally:
            writer.close()

    async def broadcast(self, call: dict[str, Any]) -> dict[str, str]:
        """Send ``call`` to every sibling and wait until each applied it; the errors by worker
        (process id). A socket no process listens on is a worker that died: skipped."""
        siblings = self._siblings()
        replies = await asyncio.gather(*(self._send(path, call) for path in siblings))
        return {
            f"worker pid {path.name.removesuffix(SOCKET_SUFFIX)}": error
            for path, error in zip(siblings, replies, strict=True)
            if error is not None
        }

    async def gather(self, call: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        """Every sibling's answer to ``call``, a reading call (``answers``); a sibling that
        does not answer within ``timeout_s``, or fails to, is left out."""
        siblings = self._siblings()
        replies = await asyncio.gather(*(self._exchange(p, call, timeout_s) for p in siblings))
        answers = [reply.get("answer") for reply in replies if isinstance(reply, dict)]
        return [answer for answer in answers if isinstance(answer, dict)]

    def _siblings(self) -> list[Path]:
        return [p for p in self.directory.glob(f"*{SOCKET_SUFFIX}") if p.resolve() != self._path]

    async def _send(self, path: Path, call: dict[str, Any]) -> str | None:
        reply = await self._exchange(path, call, REPLY_TIMEOUT_S)
        if reply is None or isinstance(reply, str):
            return reply
        error = reply.get("error")
        return None if error is None else str(error)

    async def _exchange(
        self, path: Path, call: dict[str, Any], timeout_s: float
    ) -> dict[str, Any] | str | None:
        """The sibling's reply to ``call``; None when no process listens there (a worker that
        died), or why there is no reply."""
        try:
            reader, writer = await asyncio.open_unix_connection(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # noqa: ASYNC240 (one unlink, no waiting)
            return None
        try:
            writer.write(json.dumps(call).encode() + b"\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), timeout_s)
        except (OSError, TimeoutError) as exc:
            return f"no answer: {type(exc).__name__}: {exc}"
        finally:
            writer.close()
        if not line:
            return "closed the connection before answering (it may have stopped)"
        reply = json.loads(line)
        return reply if isinstance(reply, dict) else "an answer that is no JSON object"

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
