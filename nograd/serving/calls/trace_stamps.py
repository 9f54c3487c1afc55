"""Where a sampled request's trace is stamped inside the serving core: QUEUE_START as its part
goes to the model's batcher (or as an ensemble's request starts its steps), COMPUTE_START and
COMPUTE_END around the forward that computes it. The part carries its trace to the device
thread; the batcher never knows of traces. An ensemble's steps trace under child traces
(``nograd.observability.tracing.step_trace``), so the ensemble's own trace has no compute, as
in Triton.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from nograd.observability.tracing import ACTIVE
from nograd.runtime.handler import Outputs, TensorPart
from nograd.serving.registry import ServedModel


def request_part(
    model: ServedModel, part: TensorPart, responder: Any, sequence: Any = None
) -> TensorPart:
    """The part a request queues: with the responder of a decoupled model's call, the step of a
    sequence model's request, and the request's trace (stamped QUEUE_START) when it is
    sampled."""
    trace = ACTIVE.get()
    if trace is None:
        if responder is None and sequence is None:
            return part
        return replace(part, responder=responder, sequence=sequence)
    trace.version = model.version
    trace.stamp("QUEUE_START", first=True)
    return replace(part, responder=responder, sequence=sequence, trace=trace)


def ensemble_queued(model: ServedModel) -> None:
    """An ensemble's sampled request starts its steps: its trace stamped QUEUE_START (Triton's
    ensemble scheduler stamps it as the request enters)."""
    trace = ACTIVE.get()
    if trace is not None:
        trace.version = model.version
        trace.stamp("QUEUE_START", first=True)


class TracedRunner:
    """A model's runner that stamps the traces of the parts a batch computes."""

    def __init__(self, runner: Any) -> None:
        self._runner = runner

    def run_batch(self, parts: Sequence[TensorPart]) -> list[Outputs]:
        traces = [part.trace for part in parts if part.trace is not None]
        if not traces:
            results: list[Outputs] = self._runner.run_batch(parts)
            return results
        started = time.perf_counter_ns()
        try:
            results = self._runner.run_batch(parts)
        finally:
            ended = time.perf_counter_ns()
            for trace in traces:
                trace.stamp("COMPUTE_START", started, first=True)
                trace.stamp("COMPUTE_END", ended)
        return results

    def concat(self, results: Sequence[Outputs]) -> Outputs:
        joined: Outputs = self._runner.concat(results)
        return joined

    def is_out_of_memory(self, exc: BaseException) -> bool:
        return bool(self._runner.is_out_of_memory(exc))

    def release_memory(self) -> None:
        self._runner.release_memory()
