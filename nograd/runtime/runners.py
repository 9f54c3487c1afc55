"""What runs a model's batches: a torch handler's forward (``TorchRunner``), or a model whose
batches run as its own code (``RequestRunner``: Triton's Python backend, TorchServe handlers, ONNX
models of strings), which is the batcher's ``Runner`` itself, with no forward, collation or
``inference_mode`` of nograd's around it.

Either kind is a ``Handler`` to the serving core: it prepares requests, states its config and
device, and is closed when its version is freed; ``batch_runner`` gives the batcher's runner of
either, its width granted by the core ledger when workers share the cores, and
``loop_thread_runner`` the runner of a torch model's short CPU batches on the event loop's thread.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import ClassVar, Final

import numpy as np
import torch

from nograd.host.cpu_batches import BatchCores
from nograd.host.ledger import CoreLedger
from nograd.runtime.handler import (
    ModelHandler,
    Outputs,
    RunnerBase,
    SpeedPath,
    TensorPart,
    TorchRunner,
    tensor_part,
)
from nograd.schema.config import ModelConfig

WIDE_FORWARD_S: Final = 0.003
"""With shared cores, a batch runs on more than one thread only when the model's last batch took
this long: sub-millisecond forwards gain nothing from a second thread, whose spinning between ops
takes the core the event loop and the client need."""


class RequestRunner(RunnerBase):
    """A model that takes the batcher's requests as they came and answers each: its own code
    runs the batch (``run_batch``), on host arrays.

    Its code is opaque and may act on what it receives, so by default it runs on requests only,
    never on synthetic batches (no warm-up, memory profile or engine choice) and its batch limit
    is its config's; one that can repeat a real request (a TorchServe sample) says so with
    ``synthetic_inputs`` and an ``example`` of it.
    """

    synthetic_inputs: bool = False
    """True when ``example`` makes requests the model reads (see ``ModelHandler``)."""
    prepare_offload: ClassVar[bool] = False
    """Its ``prepare`` is light: run on the event loop (see ``ModelHandler``)."""
    max_length: int | None = None
    """No token budget of its own (see ``ModelHandler``)."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.speed_path: SpeedPath | None = None
        """An engine the model runs its batches on (ONNX Runtime for strings), so the memory
        plan, the cores' sharing and the ready summary see it; None: its code alone."""
        self.weights_bytes = 0
        """Bytes its weights hold beyond the engine's: what the model costs before any batch."""

    def prepare(self, inputs: Mapping[str, np.ndarray]) -> TensorPart:
        """Validated inputs as one request's part; runs before queueing, off the device."""
        return tensor_part(inputs, self.config.inputs)

    def example(self, rows: int, length: int = 1, seed: int = 0) -> TensorPart:
        """A request runner makes no synthetic inputs unless it repeats a real request."""
        raise RuntimeError(f"model {self.config.name!r} runs on requests only")

    def run_batch(self, parts: Sequence[TensorPart]) -> list[Outputs]:
        """Each part's outputs, in order; an exception in a part's place fails that request
        alone (the batcher answers each part with its own outcome)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the model holds beyond its memory (Triton's ``finalize``), when its
        version is freed."""


Handler = ModelHandler | RequestRunner
"""What serves one model version: a torch handler, or a model running its own batches."""


class _ThreadWidthRunner:
    """A CPU model's ``runner`` at a width of torch's intra-op threads chosen batch by batch; all
    but the batch itself is the runner's own."""

    def __init__(self, runner: TorchRunner | RequestRunner) -> None:
        self.runner = runner

    def concat(self, results: Sequence[Outputs]) -> Outputs:
        return self.runner.concat(results)

    def is_out_of_memory(self, exc: BaseException) -> bool:
        return self.runner.is_out_of_memory(exc)

    def release_memory(self) -> None:
        self.runner.release_memory()


class SharedCoresRunner(_ThreadWidthRunner):
    """A CPU model's runner whose batches run at the width granted them: several workers share
    the cores (``nograd/host/ledger.py``), or several batches of one process do
    (``nograd/host/cpu_batches.py``), and a batch takes what the others leave free; a forward too
    short to gain from more threads keeps one."""

    def __init__(self, runner: TorchRunner | RequestRunner, cores: CoreLedger | BatchCores) -> None:
        super().__init__(runner)
        self._cores = cores
        self._seconds = float("inf")
        """This model's last batch; unknown counts as long."""

    def run_batch(self, parts: Sequence[TensorPart]) -> list[Outputs]:
        threads = self._cores.acquire(None if self._seconds >= WIDE_FORWARD_S else 1)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        started = time.perf_counter()
        try:
            return self.runner.run_batch(parts)
        finally:
            self._cores.release()
            self._seconds = time.perf_counter() - started


def batch_runner(
    handler: Handler, cores: CoreLedger | BatchCores | None = None, path: SpeedPath | None = None
) -> TorchRunner | RequestRunner | SharedCoresRunner:
    """The batcher's runner of ``handler``: a request runner is its own, a torch handler's is a
    ``TorchRunner`` (through ``path`` when given: the engine choice and the memory plan run one
    engine at a time). ``cores``: what a CPU model's batches take their width from."""
    runner: TorchRunner | RequestRunner = (
        handler if isinstance(handler, RequestRunner) else TorchRunner(handler, path=path)
    )
    if cores is None or handler.device.type != "cpu":
        return runner
    return SharedCoresRunner(runner, cores)


class LoopThreadRunner(_ThreadWidthRunner):
    """A CPU model's short batch run by the thread that calls it, the serving event loop's: at one
    intra-op thread (torch's width is per thread), taking no core from the ledger, as that
    thread is running already and counted as the process's own."""

    def run_batch(self, parts: Sequence[TensorPart]) -> list[Outputs]:
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)
        return self.runner.run_batch(parts)


def loop_thread_runner(
    runner: TorchRunner | RequestRunner | SharedCoresRunner,
) -> LoopThreadRunner | None:
    """The event loop's runner of the same model as the batcher's ``runner``: a torch forward on
    the CPU, whose time nograd measures; None for another device (the loop would wait on it) and
    for a model whose own code runs its batches (it may block for as long as it likes)."""
    inner = runner.runner if isinstance(runner, SharedCoresRunner) else runner
    if not isinstance(inner, TorchRunner) or inner.handler.device.type != "cpu":
        return None
    return LoopThreadRunner(inner)
