"""The CPU device's threads when one process runs several CPU batches at once.

A thread pool hands each task to whichever idle thread has waited longest, so with two idle
threads a lone stream of small batches alternated between them, each batch waking a thread that
had slept longer (its caches, its core, its OpenMP team gone cold), and a small model served
fewer requests one at a time than on one thread (BENCHMARKS.md). Here the thread idle most recently
takes the next task, so consecutive batches run on one thread, and a second one runs only while
the first is busy.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class LastIdleExecutor(Executor):
    """``threads`` threads, the most recently idle one taking each new task; tasks wait in
    order while every thread is busy."""

    def __init__(self, threads: int, name: str) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Thread] = []
        """Idle threads, the most recently idle last."""
        self._waiting: deque[Task] = deque()
        self._closed = False
        self._threads = [_Thread(self, f"{name}-{i}") for i in range(max(1, threads))]

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        task: Task = (future, fn, args, kwargs)
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if not self._idle:
                self._waiting.append(task)
                return future
            thread = self._idle.pop()
        thread.hand(task)
        return future

    def next_task(self, thread: _Thread) -> Task | None:
        """A waiting task for ``thread``; None when there is none (it is idle from now on), or
        when the executor is shut down (``closed`` says which)."""
        with self._lock:
            if self._waiting:
                return self._waiting.popleft()
            if not self._closed:
                self._idle.append(thread)
            return None

    @property
    def closed(self) -> bool:
        return self._closed

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            if cancel_futures:
                while self._waiting:
                    self._waiting.popleft()[0].cancel()
            idle, self._idle = self._idle, []
        for thread in idle:
            thread.hand(None)
        if wait:
            for thread in self._threads:
                if thread.thread is not threading.current_thread():
                    thread.thread.join()


class _Thread:
    """One of the executor's threads: runs the task handed to it, then any waiting ones."""

    def __init__(self, executor: LastIdleExecutor, name: str) -> None:
        self._executor = executor
        self._handed = threading.Event()
        self._task: Task | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def hand(self, task: Task | None) -> None:
        """Give this idle thread ``task``, or None to end it."""
        self._task = task
        self._handed.set()

    def _run(self) -> None:
        while True:
            task = self._executor.next_task(self)
            if task is None:
                if self._executor.closed and not self._handed.is_set():
                    return
                self._handed.wait()
                self._handed.clear()
                task, self._task = self._task, None
                if task is None:
                    return
            future, fn, args, kwargs = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
            del task, future, fn, args, kwargs
