"""Warmup: the first forwards pay for lazy initialisation (kernels, allocator pools, thread pools),
so they run before a model reports ready instead of on a user's request."""

from __future__ import annotations

import logging

from nograd.runtime.memory import MemoryProbe, is_out_of_memory
from nograd.runtime.memory.cost import Point
from nograd.runtime.runners import Handler, batch_runner

logger = logging.getLogger(__name__)


def warmup_shapes(handler: Handler, limit: int) -> list[tuple[int, int]]:
    """A few (rows, length) pairs spanning the batch range the model will see."""
    if handler.config.batch_unit == "tokens":
        lengths = sorted({8, 32, 128})
        return [(rows, length) for length in lengths for rows in (1, 8) if rows * length <= limit]
    sizes = sorted({1, min(8, limit), limit})
    return [(rows, 1) for rows in sizes]


def warm_up(
    handler: Handler, limit: int, rounds: int = 2, probe: MemoryProbe | None = None
) -> list[Point]:
    """Run the warmup shapes; a batch that runs out of memory is skipped, not fatal. With a
    ``probe``, the last round's batches are measured as they run (the first round paid what a
    process and a shape initialise once, which a measure of the batch's need would count): the
    (rows, length, peak bytes) returned.

    Running out of memory at a large warmup batch says the configured cap is too high for the
    device, which the memory plan and the batcher's OOM recovery handle; only a single sample
    that cannot run makes the model unservable.
    """
    runner = batch_runner(handler)
    measured: list[Point] = []
    for round_ in range(rounds):
        for rows, length in warmup_shapes(handler, limit):

            def run(rows: int = rows, length: int = length) -> object:
                return runner.run_batch([handler.example(rows, length)])

            try:
                if probe is not None and round_ == rounds - 1:
                    measured.append((rows, length, probe.measure_peak(run)))
                else:
                    run()
            except Exception as exc:
                if rows == 1 or not is_out_of_memory(exc):
                    raise
                runner.release_memory()
                logger.warning(
                    "model %s: warmup batch of %d rows ran out of memory; skipped",
                    handler.config.name,
                    rows,
                )
    logger.debug("model %s warmed up", handler.config.name)
    return measured
