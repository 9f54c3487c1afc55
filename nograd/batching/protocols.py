"""What the batcher works with, as protocols: the parts it queues, the runner that computes them,
the observer that records what happens, and the padded cost a batch is limited by."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, Self, TypeVar


class Part(Protocol):
    """A unit of work: ``rows`` samples of padded length ``length`` (1 for non-sequence models)."""

    @property
    def rows(self) -> int: ...

    @property
    def length(self) -> int: ...

    def slice(self, start: int, stop: int) -> Self: ...


P = TypeVar("P", bound=Part)
P_contra = TypeVar("P_contra", bound=Part, contravariant=True)
R = TypeVar("R")


class Runner(Protocol[P_contra, R]):
    """What the batcher needs from a model; all but ``concat`` run on the device thread."""

    def run_batch(self, parts: Sequence[P_contra]) -> list[R]:
        """One forward over ``parts``; one result per part, in order."""
        ...

    def concat(self, results: Sequence[R]) -> R:
        """Reassemble the results of consecutive row slices of one part."""
        ...

    def is_out_of_memory(self, exc: BaseException) -> bool: ...

    def release_memory(self) -> None: ...


class BatchObserver(Protocol):
    """Hooks for metrics; the batcher never imports the metrics module itself."""

    def queue_depth(self, depth: int) -> None: ...

    def batch_started(self, rows: int, cost: int, queue_waits: Sequence[float]) -> None: ...

    def batch_finished(self, rows: int, seconds: float, ok: bool) -> None: ...

    def out_of_memory(self, cost: int) -> None: ...

    def split(self) -> None: ...

    def limit_changed(self, limit: int) -> None: ...

    def dropped(self, reason: str) -> None: ...


class NullObserver:
    """Observer that records nothing: the default for tests and tools."""

    def queue_depth(self, depth: int) -> None:
        pass

    def batch_started(self, rows: int, cost: int, queue_waits: Sequence[float]) -> None:
        pass

    def batch_finished(self, rows: int, seconds: float, ok: bool) -> None:
        pass

    def out_of_memory(self, cost: int) -> None:
        pass

    def split(self) -> None:
        pass

    def limit_changed(self, limit: int) -> None:
        pass

    def dropped(self, reason: str) -> None:
        pass


def padded_cost(rows: int, longest: int, unit_tokens: bool) -> int:
    """A batch's cost against its limit: rows for sample models, rows × longest for token models
    (every part is padded to the longest)."""
    return rows * longest if unit_tokens else rows


def cost_of(parts: Sequence[Part], unit_tokens: bool) -> int:
    """Padded cost of a batch of ``parts``."""
    longest = max((p.length for p in parts), default=0)
    return padded_cost(sum(p.rows for p in parts), longest, unit_tokens)
