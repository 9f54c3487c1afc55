"""Running a batch on the device thread so that every request gets its own outcome.

A batch that runs out of memory is split in halves and retried (and the limit learns from it); a
batch that raises is bisected until only the guilty request fails; one sample that alone does not
fit fails with ``SampleTooLarge``. Results are regrouped per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic

from nograd.batching.errors import SampleTooLarge
from nograd.batching.limit import BatchLimit
from nograd.batching.protocols import BatchObserver, P, R, Runner, cost_of


@dataclass
class Recovery(Generic[P, R]):
    """One model's way of running a batch to per-request outcomes; called on the device thread."""

    name: str
    runner: Runner[P, R]
    limit: BatchLimit
    observer: BatchObserver
    unit_tokens: bool

    def run(self, parts: list[P]) -> list[R | BaseException]:
        """Run on the device thread: split on out-of-memory, bisect on errors, per part outcomes."""
        outcomes = self._run_pieces(list(enumerate(parts)))
        grouped: list[list[R]] = [[] for _ in parts]
        failed: dict[int, BaseException] = {}
        for (index, _), outcome in outcomes:
            if isinstance(outcome, BaseException):
                failed.setdefault(index, outcome)
            else:
                grouped[index].append(outcome)
        return [
            failed[index]
            if index in failed
            else (group[0] if len(group) == 1 else self.runner.concat(group))
            for index, group in enumerate(grouped)
        ]

    def _run_pieces(
        self, pieces: list[tuple[int, P]]
    ) -> list[tuple[tuple[int, P], R | BaseException]]:
        parts = [p for _, p in pieces]
        cost = cost_of(parts, self.unit_tokens)
        try:
            results = self.runner.run_batch(parts)
            if len(results) != len(parts):
                raise RuntimeError(
                    f"model {self.name!r} returned {len(results)} results for {len(parts)} parts"
                )
        except Exception as exc:
            if self.runner.is_out_of_memory(exc):
                return self._recover_out_of_memory(pieces, cost, exc)
            if len(pieces) == 1:
                return [(pieces[0], exc)]
            self.observer.split()
            half = len(pieces) // 2
            return self._run_pieces(pieces[:half]) + self._run_pieces(pieces[half:])
        self.limit.record_success(cost)
        self._notify_limit()
        return list(zip(pieces, results, strict=True))

    def _recover_out_of_memory(
        self, pieces: list[tuple[int, P]], cost: int, exc: Exception
    ) -> list[tuple[tuple[int, P], R | BaseException]]:
        self.observer.out_of_memory(cost)
        self.runner.release_memory()
        self.limit.record_out_of_memory(cost)
        self._notify_limit()
        rows = sum(p.rows for _, p in pieces)
        if rows <= 1:
            too_large = SampleTooLarge(
                f"one sample does not fit in device memory for model {self.name!r}: {exc}"
            )
            return [(pieces[0], too_large)]
        self.observer.split()
        first, second = _halve(pieces)
        return self._run_pieces(first) + self._run_pieces(second)

    def _notify_limit(self) -> None:
        if self.limit.changed():
            self.observer.limit_changed(self.limit.current)


def _halve(pieces: list[tuple[int, P]]) -> tuple[list[tuple[int, P]], list[tuple[int, P]]]:
    """Split pieces into two halves by rows, slicing the part that straddles the middle."""
    total = sum(p.rows for _, p in pieces)
    target = total // 2
    first: list[tuple[int, P]] = []
    second: list[tuple[int, P]] = []
    seen = 0
    for index, part in pieces:
        if seen >= target:
            second.append((index, part))
        elif seen + part.rows <= target:
            first.append((index, part))
        else:
            cut = target - seen
            first.append((index, part.slice(0, cut)))
            second.append((index, part.slice(cut, part.rows)))
        seen += part.rows
    return first, second
