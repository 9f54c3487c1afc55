"""What each batch of this process may take of its device: the CPU cores (shared with the other
workers through their ledger, or among this process's own batches in flight) and the device's
activation memory (split among every batch that may run on it at once)."""

from __future__ import annotations

import logging

from nograd.host.cpu_batches import BatchCores, planned_cpu_batches
from nograd.host.ledger import CoreLedger, CoreShare
from nograd.host.readings import usable_cores
from nograd.runtime.devices import DeviceThreads, configure_threads
from nograd.runtime.engines.onnx import spin_after_runs
from nograd.runtime.handler import ModelHandler
from nograd.runtime.memory import device_budget, probe_for
from nograd.serving.registry import ServedModel
from nograd.settings import Settings

logger = logging.getLogger(__name__)


class DeviceShares:
    """The device threads, the cores each CPU batch runs on, and each batch's memory budget."""

    def __init__(self, settings: Settings, cores: CoreShare | None = None) -> None:
        self._settings = settings
        self._core_share = cores
        self.threads = DeviceThreads(
            planned_cpu_batches(
                settings.cpu_batches,
                bool(settings.front_count),
                settings.cores_shared,
                usable_cores(),
            )
        )
        """One thread per GPU, ``cpu_batches`` for the CPU, running their models' loads and
        batches."""
        self.cores: CoreLedger | BatchCores | None = None
        """Joined before the first load: the CPU cores shared with the other workers, or among
        this process's CPU batches, batch by batch."""
        self.widths: tuple[int, ...] = ()
        """The intra-op widths a batch may be granted when the cores are shared."""
        self._pools: dict[str, int] = {}
        """Per device, the memory first planned (activation budget plus weights)."""

    @property
    def ledger(self) -> CoreLedger | None:
        """The workers' shared ledger, when this process is one of several workers."""
        return self.cores if isinstance(self.cores, CoreLedger) else None

    def join_cores(self) -> None:
        """Set torch's width (and ONNX Runtime's spinning) before any model loads."""
        share = self._core_share
        workers = self._settings.worker_count
        batches = self.threads.cpu_batches
        # No fronts, no other workers, no other batch of its own beside a batch.
        alone = share is None and not self._settings.front_count and batches == 1
        spin_after_runs(alone and self._settings.model_control != "on_demand")
        shared = share is not None or (batches > 1 and self._settings.cores_shared)
        threads = configure_threads(self._settings.torch_threads, workers * batches, shared=shared)
        if shared:
            self.widths = tuple(range(1, threads + 1))
        if share is not None:
            self.cores = CoreLedger(share, threads)
            logger.info(
                "torch intra-op threads: up to %d per batch, the cores the other %d workers' "
                "batches leave free",
                threads,
                workers - 1,
            )
            return
        if shared:
            self.cores = BatchCores(threads)
        logger.info(
            "torch intra-op threads: %s%d per batch, %d CPU batch%s at once",
            "up to " if shared else "",
            threads,
            batches,
            "es" if batches > 1 else "",
        )

    def batches(self, model: ServedModel) -> tuple[int, int]:
        """A model's batches running at once and staged behind them. A torch forward's run side
        by side on the CPU's threads; a model whose own code runs its batches, or whose
        sequences must keep their order, runs one at a time, with none staged (another thread
        would start it)."""
        handler = model.handler
        assert handler is not None
        batches = self.threads.cpu_batches
        if batches == 1 or handler.device.type != "cpu":
            return 1, 1
        if isinstance(handler, ModelHandler) and model.config.sequence is None:
            return batches, 1
        return 1, 0

    def budget(self, label: str, group: list[ServedModel]) -> int:
        """A batch's activation budget on device ``label``: an operator's budget (each worker
        takes an equal part), or the one measured; on the CPU split again among the batches
        this process runs at once.

        Worker processes share the device: each takes an equal part of what it sees free (a
        budget reserves nothing, so a later worker sees the earlier ones' budgets as free).
        Measured once per device: later plans keep that pool of memory (activations plus
        weights) and subtract the weights loaded at the time, as freed activation memory may
        still be held by the allocator and would not read as free."""
        return self._process_budget(label, group) // self.at_once(label)

    def at_once(self, label: str) -> int:
        """Batches this process runs at once on device ``label``, each on its own budget."""
        return self.threads.cpu_batches if label == "cpu" else 1

    def _process_budget(self, label: str, group: list[ServedModel]) -> int:
        workers = self._settings.worker_count
        explicit = self._settings.memory_budget_bytes
        if explicit:
            return explicit // workers
        weights = sum(m.weights_bytes for m in group)
        limit = self._settings.memory_limit_bytes
        if limit and self._settings.model_control == "on_demand":
            # On demand, batches share what the resident models leave of the limit.
            held = sum(max(m.weights_bytes, m.resident_bytes) for m in group)
            return max(0, limit // workers - held)
        pool = self._pools.get(label)
        if pool is None:
            assert group[0].handler is not None
            probe = probe_for(group[0].handler.device)
            budget = device_budget(probe, self._settings.memory_fraction / workers, None)
            self._pools[label] = budget + weights
            return budget
        return max(0, pool - weights)
