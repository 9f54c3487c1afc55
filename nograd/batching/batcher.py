"""The dynamic batcher: one per model, no HTTP and no torch.

Requests (``Part``s) queue on the event loop; a batch loop forms batches whose cost fits the current
limit and hands them to a runner on the model's device thread, or runs a short CPU batch on the
event loop's own thread. Every caller's future is resolved,
whatever happens: cancelled callers are dropped before their batch runs, a failing batch is bisected
so only the guilty request fails, and an out-of-memory batch is split in halves and retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Executor
from dataclasses import replace
from typing import Final, Generic

from nograd.batching.errors import (
    BatcherClosed,
    DeadlineExceeded,
    QueueFull,
    SampleTooLarge,
    fail,
)
from nograd.batching.execution import Item, execute
from nograd.batching.limit import BatchLimit
from nograd.batching.protocols import (
    BatchObserver,
    NullObserver,
    P,
    R,
    Runner,
    cost_of,
    padded_cost,
)
from nograd.batching.recovery import Recovery
from nograd.batching.timing import BatchTiming, refuse_long_wait

logger = logging.getLogger(__name__)

SIDE_BY_SIDE_S: Final = 0.003
"""A model runs several batches at once (``max_running_batches``) once its usual batch takes this
long: a shorter one gains less from a thread of its own than its extra batches cost the loop."""


class Batcher(Generic[P, R]):
    """Queue + batch loop for one model.

    Work-conserving: when the model runs fewer batches than its device may run at once
    (``max_running_batches``: one, or a CPU's batches side by side), whatever is queued is
    dispatched at once. While the device is full, the next one fills; it goes to the device as
    soon as a running batch ends, it is full, or its oldest request has waited
    ``max_queue_delay_s`` and the device is expected to free within ``max_queue_delay_s``. A
    batch handed over earlier would only wait for the device with fewer batch-mates. The
    expectation comes from the model's measured batch times (``BatchTiming``); wrong either
    way, it costs what it saves: too short and the batch leaves early, too long and it leaves
    when the device frees, one event-loop turn later.
    """

    def __init__(
        self,
        name: str,
        runner: Runner[P, R],
        executor: Executor,
        limit: BatchLimit,
        *,
        max_queue_delay_s: float,
        max_queue_size: int,
        unit_tokens: bool = False,
        observer: BatchObserver | None = None,
        max_staged_batches: int = 1,
        max_running_batches: int = 1,
        group_of: Callable[[P], Hashable] | None = None,
        loop_runner: Runner[P, R] | None = None,
        max_loop_batch_s: float = 0.0,
    ) -> None:
        """``group_of``: parts of different groups (sets of optional inputs) never share a batch.
        ``loop_runner``: runs on the event loop's thread a batch expected to take at most
        ``max_loop_batch_s`` while none of the model's is on the device: no hop to the device
        thread and back, no wait for the lock the loop holds, for a forward shorter than both."""
        self.name = name
        self._group_of = group_of
        self._runner = runner
        self._executor = executor
        self.limit = limit
        self._delay = max_queue_delay_s
        self._max_queue_size = max_queue_size
        self._unit_tokens = unit_tokens
        self._observer: BatchObserver = observer or NullObserver()
        self._recovery = Recovery(name, runner, limit, self._observer, unit_tokens)
        self._loop_recovery = (
            None if loop_runner is None else replace(self._recovery, runner=loop_runner)
        )
        self.max_loop_batch_s = max_loop_batch_s
        # Asyncio objects are created in start(), on the running loop, never at construction.
        self._queue: deque[Item[P, R]] = deque()
        self._wakeup: asyncio.Event | None = None
        self.max_running_batches = max(1, max_running_batches)  # on a device running several
        self.max_staged_batches = max_staged_batches  # filled while the device is full
        self._in_flight = 0
        self._rows_in_flight = 0
        self._task: asyncio.Task[None] | None = None
        self._batch_tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._timing = BatchTiming()
        """Learned on the device thread from each batch that ran; unknown until one has."""
        self._estimates: deque[float] = deque()
        """Expected seconds of each batch handed to the device and not yet finished, in order."""
        self._free_at = 0.0
        """When the device is expected to have finished every batch handed to it (monotonic)."""
        self._queued_cost = 0
        """Padded cost of every queued item, each on its own: what waits for the device."""

    # ----------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self._task is not None:
            return
        self._wakeup = asyncio.Event()
        self._closed = False
        self._task = asyncio.create_task(self._loop(), name=f"batcher-{self.name}")

    @property
    def alive(self) -> bool:
        """False when the batch loop has died; health reports it and the server restarts it."""
        return self._task is not None and not self._task.done()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def expected_wait_s(self) -> float:
        """Seconds a request queued now is expected to wait before its batch starts: the batches
        on the device, then everything queued, at the model's measured speed (0 until a batch
        has been measured), shared among the batches it runs at once."""
        busy = max(0.0, self._free_at - time.monotonic())
        queued = self._timing.queue_s(self._queued_cost, self.limit.current)
        return (busy + queued) / self._running_now()

    def usual_batch_s(self) -> float:
        """Expected seconds of one batch of the size this model has lately been running; not
        one at the limit, which for a token model may hold far more than it ever batches (a
        floor of one such batch let its queue grow past any bound before shedding began)."""
        return self._timing.batch_s(self._timing.usual_cost)

    async def restart_if_dead(self) -> bool:
        """Restart a dead batch loop; True when a restart happened."""
        if self._task is None or not self._task.done() or self._closed:
            return False
        self._task = None
        await self.start()
        return True

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Refuse new work; let queued and running batches finish in the timeout; fail the rest."""
        self._closed = True
        if self._wakeup is not None:
            self._wakeup.set()
        deadline = time.monotonic() + drain_timeout_s
        if self._task is not None and drain_timeout_s > 0:
            # The loop returns once closed with an empty queue: every queued item is dispatched.
            await asyncio.wait({self._task}, timeout=drain_timeout_s)
        if self._batch_tasks:
            await asyncio.wait(
                set(self._batch_tasks), timeout=max(0.0, deadline - time.monotonic())
            )
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task = None
        while self._queue:
            item = self._queue.popleft()
            fail(item.future, BatcherClosed(f"model {self.name!r} is shutting down"))
        self._queued_cost = 0
        for task in list(self._batch_tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ----------------------------------------------------------------------------- submit
    async def submit(
        self,
        part: P,
        *,
        deadline: float | None = None,
        max_wait_s: float | None = None,
        waited_s: float = 0.0,
    ) -> R:
        """Queue ``part`` and wait for its result; cut it into several items when over the limit.

        Refused at once (``WaitTooLong``) when the work queued ahead is expected to outlast
        ``deadline``, or to answer it, counting the ``waited_s`` it already spent on its way
        here, later than ``max_wait_s`` (``check_wait``).
        """
        if self._closed or self._wakeup is None:
            raise BatcherClosed(f"model {self.name!r} is not accepting requests")
        chunks = self._chunks(part)
        if len(self._queue) + len(chunks) > self._max_queue_size:
            raise QueueFull(f"model {self.name!r} queue is full ({self._max_queue_size} requests)")
        now = time.monotonic()
        if deadline is not None and deadline <= now:
            raise DeadlineExceeded(f"deadline passed before {self.name!r} could queue the request")
        self.check_wait(now, deadline, max_wait_s, waited_s)
        loop = asyncio.get_running_loop()
        items: list[Item[P, R]] = [
            Item(chunk, loop.create_future(), now, deadline, cost_of([chunk], self._unit_tokens))
            for chunk in chunks
        ]
        self._queue.extend(items)
        self._queued_cost += sum(item.cost for item in items)
        self._observer.queue_depth(len(self._queue))
        self._wakeup.set()
        try:
            if len(items) == 1:
                # The common case: no gather future to build, one await.
                return await items[0].future
            results = await asyncio.gather(*(item.future for item in items))
        except BaseException:
            # The caller went away (or one piece failed): drop its other pieces before they run.
            for item in items:
                if not item.future.done():
                    item.future.cancel()
            raise
        return self._runner.concat(results)

    def check_wait(
        self, now: float, deadline: float | None, max_wait_s: float | None, waited_s: float = 0.0
    ) -> None:
        """Raise ``WaitTooLong`` when a request queued ``now`` is expected to wait past its
        ``deadline`` or be answered later than ``max_wait_s`` (``refuse_long_wait``)."""
        if self._timing.known and (deadline is not None or max_wait_s is not None):
            wait, batch = self.expected_wait_s(), self.usual_batch_s()
            refuse_long_wait(self.name, wait, batch, now, deadline, max_wait_s, waited_s)

    def _chunks(self, part: P) -> list[P]:
        """Cut a request bigger than the limit into consecutive row slices that each fit."""
        rows_per_chunk = self._rows_fitting(part.length)
        if rows_per_chunk < 1:
            raise SampleTooLarge(
                f"one sample of length {part.length} does not fit model {self.name!r}'s batch "
                f"limit of {self.limit.current} {'tokens' if self._unit_tokens else 'samples'}"
            )
        if part.rows <= rows_per_chunk:
            return [part]
        return [
            part.slice(start, min(start + rows_per_chunk, part.rows))
            for start in range(0, part.rows, rows_per_chunk)
        ]

    def _rows_fitting(self, length: int) -> int:
        limit = self.limit.current
        return limit // max(length, 1) if self._unit_tokens else limit

    # ----------------------------------------------------------------------------- batch loop
    async def _loop(self) -> None:
        assert self._wakeup is not None
        while True:
            while not self._queue:
                if self._closed:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
            await self._fill_while_busy()
            while self._in_flight >= self._running_now() + self.max_staged_batches:
                self._wakeup.clear()
                await self._wakeup.wait()  # a batch ends
            batch, rows, cost = self._take_batch(self._even_share())
            if not batch:
                continue
            estimate = self._timing.batch_s(cost)
            if self._runs_on_loop(estimate):
                self._run_on_loop(batch)
                await asyncio.sleep(0)  # its answers and the requests that came meanwhile first
                continue
            self._in_flight += 1
            self._rows_in_flight += rows
            self._estimates.append(estimate)
            self._free_at = max(self._free_at, time.monotonic()) + estimate
            task = asyncio.create_task(self._run(batch, rows), name=f"batch-{self.name}")
            self._batch_tasks.add(task)
            task.add_done_callback(self._batch_tasks.discard)

    async def _fill_while_busy(self) -> None:
        """While a batch runs, the next fills until full, the model frees, or the delay has
        passed and the device is expected to free within the delay."""
        assert self._wakeup is not None
        running = self._running_now()
        if self._in_flight < running or self._delay <= 0:
            return
        oldest = self._queue[0].enqueued
        while self._in_flight >= running and not self._closed:
            if self._queued_cost_reaches_limit():
                return
            cut = max(oldest + self._delay, self._free_at - self._delay)
            remaining = cut - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), remaining)

    def _running_now(self) -> int:
        """Batches this model runs at once: ``max_running_batches`` once its batches are known
        to take ``SIDE_BY_SIDE_S``, one before and for shorter ones."""
        if self.max_running_batches > 1 and self.usual_batch_s() >= SIDE_BY_SIDE_S:
            return self.max_running_batches
        return 1

    def _queued_cost_reaches_limit(self) -> bool:
        rows = 0
        longest = 0
        for item in self._queue:
            rows += item.part.rows
            longest = max(longest, item.part.length)
        # A longer queue never costs less, so the whole queue decides.
        return padded_cost(rows, longest, self._unit_tokens) >= self.limit.current

    def _even_share(self) -> int | None:
        """Most rows for the next batch of a model running several at once: an even share of the
        rows queued and in flight, so batches side by side end about together."""
        running = self._running_now()
        if running == 1:
            return None
        queued = sum(item.part.rows for item in self._queue)
        return -(-(queued + self._rows_in_flight) // running)

    def _take_batch(self, most_rows: int | None = None) -> tuple[list[Item[P, R]], int, int]:
        """Oldest live item first (no starvation), then the queued items closest to its length,
        up to ``most_rows``; with the batch's rows and cost."""
        now = time.monotonic()
        first: Item[P, R] | None = None
        while self._queue and first is None:
            item = self._queue.popleft()
            self._queued_cost -= item.cost
            first = item if self._admit(item, now) else None
        if first is None:
            self._observer.queue_depth(len(self._queue))
            return [], 0, 0
        batch = [first]
        limit = self.limit.current
        rows, longest = first.part.rows, first.part.length
        candidates = list(self._queue)
        if self._unit_tokens:
            candidates.sort(key=lambda it: (abs(it.part.length - first.part.length), it.enqueued))
        taken: set[int] = set()
        group_of = self._group_of
        group = None if group_of is None else group_of(first.part)
        for item in candidates:
            if group_of is not None and group_of(item.part) != group:
                continue  # left queued for a batch of its own group
            new_rows = rows + item.part.rows
            if most_rows is not None and new_rows > most_rows:
                break
            new_longest = max(longest, item.part.length)
            if padded_cost(new_rows, new_longest, self._unit_tokens) > limit:
                if self._unit_tokens:
                    continue
                break
            taken.add(id(item))
            if not self._admit(item, now):
                continue
            batch.append(item)
            rows, longest = new_rows, new_longest
        if taken:
            self._queue = deque(it for it in self._queue if id(it) not in taken)
            self._queued_cost = sum(it.cost for it in self._queue)
        self._observer.queue_depth(len(self._queue))
        return batch, rows, padded_cost(rows, longest, self._unit_tokens)

    def _admit(self, item: Item[P, R], now: float) -> bool:
        """Drop work nobody waits for, or whose deadline passed, before it costs compute."""
        if item.future.done():
            self._observer.dropped("cancelled")
            return False
        if item.deadline is not None and now > item.deadline:
            self._observer.dropped("deadline")
            fail(item.future, DeadlineExceeded(f"deadline passed while queued for {self.name!r}"))
            return False
        return True

    def _runs_on_loop(self, estimate: float) -> bool:
        """Whether a batch expected to take ``estimate`` runs on the event loop's thread: short
        enough, measured, and the model has no batch on the device (its order is kept)."""
        return (
            self._loop_recovery is not None
            and self._in_flight == 0
            and self._timing.known
            and estimate <= self.max_loop_batch_s
        )

    def _run_on_loop(self, batch: list[Item[P, R]]) -> None:
        assert self._loop_recovery is not None
        try:
            live, outcomes = execute(batch, self._loop_recovery, self._timing, self._observer)
        except BaseException as exc:
            self._fail_batch(batch, exc)
            return
        _answer(live, outcomes)

    async def _run(self, batch: list[Item[P, R]], rows: int) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        try:
            live, outcomes = await loop.run_in_executor(
                self._executor, execute, batch, self._recovery, self._timing, self._observer
            )
            _answer(live, outcomes)
        except BaseException as exc:
            self._fail_batch(batch, exc)
        finally:
            self._in_flight -= 1
            self._rows_in_flight -= rows
            if self._estimates:
                self._estimates.popleft()
            self._free_at = time.monotonic() + sum(self._estimates)
            self._wakeup.set()

    def _fail_batch(self, batch: list[Item[P, R]], exc: BaseException) -> None:
        """Every future of a batch that failed as a whole is resolved, whatever happened."""
        logger.exception("batch failed for model %s", self.name)
        for item in batch:
            fail(item.future, exc if isinstance(exc, Exception) else BatcherClosed(str(exc)))
        if not isinstance(exc, Exception):
            raise exc


def _answer(live: list[Item[P, R]], outcomes: list[R | BaseException]) -> None:
    for item, outcome in zip(live, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            fail(item.future, outcome)
        elif not item.future.done():
            item.future.set_result(outcome)
