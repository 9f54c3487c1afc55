"""Profiling, at the first quiet moment, the models loaded on demand that answer on an estimate.

Such a model was planned on an estimate from its warm-up (``nograd.serving.control.profiles``)
so that its first request waited for its load only. Its real profile runs fresh sessions on the
device's thread, which batches need: it waits until no load has run for ``PROFILE_QUIET_S`` and
no request is in flight, stops between two measurements when one arrives, and tries again at the
next quiet moment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from nograd.serving.dataplane import DataPlane
from nograd.serving.residency.policy import Residency

logger = logging.getLogger(__name__)

PROFILE_QUIET_S = 0.5
"""How long no load must have been under way, with no request in flight, before a model
answering on an estimate of its memory is profiled; a load or a request arriving meanwhile stops
the profile between two measurements (its runs hold the device's thread, which batches need)."""

ProfileNow = Callable[[str, Callable[[], bool]], Awaitable[bool]]
"""Profile a model now and count it on what was measured, stopping between two measurements
when the callable it is given says so; False when it was stopped."""


class BackgroundProfiles:
    """The profile task of each model answering on an estimate of its memory, run one load or
    eviction at a time as loads are (under the on-demand ``lock``)."""

    def __init__(
        self,
        plane: DataPlane,
        residency: Residency,
        loads: Mapping[str, object],
        lock: asyncio.Lock,
        profile_now: ProfileNow,
    ) -> None:
        self._plane = plane
        self._residency = residency
        self._loads = loads
        """The loads under way or waiting (the on-demand control's): a profile waits for them."""
        self._lock = lock
        self._profile_now = profile_now
        self._profiling: dict[str, asyncio.Task[None]] = {}
        """Per model answering on an estimate of its memory, the task that profiles it."""
        self._loads_ended = time.monotonic()
        """When the last load ended (``time.monotonic``): profiles wait for a quiet moment."""

    def load_ended(self) -> None:
        """A load ended: the quiet moment a profile waits for starts from now."""
        self._loads_ended = time.monotonic()

    def profile_when_quiet(self, name: str) -> None:
        """Profile ``name`` later (``_profile_later``) if it serves on an estimate of its
        memory and is not to be profiled already."""
        if self._plane.unmeasured(name) and name not in self._profiling:
            task = asyncio.create_task(self._profile_later(name), name=f"profile-{name}")
            self._profiling[name] = task
            task.add_done_callback(self._profiled)

    async def _profile_later(self, name: str) -> None:
        """Profile ``name``, which answers on an estimate of its memory, at the first quiet
        moment (``PROFILE_QUIET_S``), one load or eviction at a time as loads are; a load or a
        request arriving stops it, and it waits for the next quiet moment. Nothing once the
        model is evicted."""
        while True:
            await self._quiet()
            async with self._lock:
                if name not in self._residency.resident or not self._plane.unmeasured(name):
                    return
                if not self._busy() and await self._profile_now(name, self._busy):
                    return

    def _busy(self) -> bool:
        """Whether a load is under way or waiting, or a request is in flight."""
        return bool(self._loads) or not self._plane.idle

    async def _quiet(self) -> None:
        """Return once no load has been under way for ``PROFILE_QUIET_S`` and no request is in
        flight."""
        while True:
            left = self._loads_ended + PROFILE_QUIET_S - time.monotonic()
            if not self._busy() and left <= 0:
                return
            await asyncio.sleep(left if left > 0 else PROFILE_QUIET_S)

    def _profiled(self, task: asyncio.Task[None]) -> None:
        name = task.get_name().removeprefix("profile-")
        if self._profiling.get(name) is task:
            del self._profiling[name]
        if not task.cancelled() and task.exception() is not None:
            logger.error("model %s: profiling failed", name, exc_info=task.exception())
