"""Live tensor tracking on CPU: views counted once, resizes followed, per thread."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from pathlib import Path

import torch

from nograd.runtime.memory import (
    LiveTensorTracker,
)
from tests.unit.runtime.memory.conftest import mlp

FLOAT32 = 4
ROOT = Path(__file__).resolve().parents[4]


def test_tracker_counts_views_once_and_frees() -> None:
    with LiveTensorTracker() as tracker:
        base = torch.empty(1000)
        views = [base.view(10, 100), base[::2], base.unsqueeze(0), base.detach()]
        base.add_(1)  # in place: same storage, nothing new
        assert tracker.current_bytes == 1000 * FLOAT32
        assert tracker.live_storages == 1
        del base
        assert tracker.current_bytes == 1000 * FLOAT32  # views keep the storage alive
        views.clear()
        assert tracker.current_bytes == 0
        assert tracker.live_storages == 0
    assert tracker.peak_bytes == 1000 * FLOAT32


def test_tracker_ignores_preexisting_storages() -> None:
    weight = torch.randn(64, 32)
    out = torch.empty(64, 32)
    with LiveTensorTracker() as tracker:
        transposed = weight.t()  # a view of a buffer someone else owns
        torch.add(weight, 1, out=out)  # writes into an existing buffer
        assert tracker.current_bytes == 0
        fresh = weight * 2
        assert tracker.current_bytes == fresh.numel() * FLOAT32
    del transposed, fresh


def test_tracker_follows_resize() -> None:
    with LiveTensorTracker() as tracker:
        grown = torch.empty(0)
        grown.resize_(256)
        assert tracker.current_bytes == 256 * FLOAT32
    del grown
    assert tracker.current_bytes == 0


def test_tracker_only_counts_its_device_type() -> None:
    with LiveTensorTracker("cpu") as tracker:
        meta = torch.empty(1 << 20, device="meta")
        assert tracker.current_bytes == 0
    del meta


def test_tracker_works_with_inference_tensors() -> None:
    with torch.inference_mode(), LiveTensorTracker() as tracker:
        x = torch.ones(128)
        y = x * 3
        assert y.is_inference()
        assert tracker.current_bytes == 2 * 128 * FLOAT32
        del x, y
        assert tracker.current_bytes == 0


def test_tracker_is_thread_local() -> None:
    # Dispatch modes live in thread-local state: profile on the thread that runs the forward.
    kept: list[torch.Tensor] = []
    with LiveTensorTracker() as tracker:
        worker = threading.Thread(target=lambda: kept.append(torch.empty(1000)))
        worker.start()
        worker.join()
        assert tracker.current_bytes == 0


def test_forward_outputs_dropped_return_to_baseline() -> None:
    model = mlp()
    with torch.inference_mode(), LiveTensorTracker() as tracker:
        kept = torch.zeros(100)
        baseline = tracker.current_bytes
        out = model(torch.randn(16, 512))
        assert tracker.current_bytes > baseline
        del out
        gc.collect()
        assert tracker.current_bytes == baseline
        assert tracker.live_storages == 1
        assert tracker.peak_bytes > baseline
    del kept


def test_tracking_leaves_torchs_compiler_unloaded() -> None:
    """Every server start measures memory through the tracker: loading dynamo (torch's compiler
    stack) for it would cost each start seconds, in a process that may never compile."""
    script = (
        "import sys, torch\n"
        "from nograd.runtime.memory import LiveTensorTracker\n"
        "with LiveTensorTracker() as tracker:\n"
        "    kept = torch.ones(100) * 2\n"
        "assert tracker.peak_bytes == 2 * 100 * 4, tracker.peak_bytes\n"
        "assert 'torch._dynamo' not in sys.modules, 'the tracker loaded torch._dynamo'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_tracker_counts_a_compiled_forward() -> None:
    """Once dynamo is loaded (a speed mode compiles), the tracker keeps counting, and dynamo
    never traces into it."""
    import torch._dynamo

    torch._dynamo.reset()
    doubled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    inputs = torch.ones(256)
    with LiveTensorTracker() as tracker:
        out = doubled(inputs)
    assert torch.equal(out, torch.full((256,), 3.0))
    assert tracker.peak_bytes >= 256 * FLOAT32
