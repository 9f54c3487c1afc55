"""CUDA graphs through fakes of torch.cuda: capture per shape, replay into static buffers."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import ClassVar

import numpy as np
import pytest
import torch

from nograd.runtime.handler import ModelHandler, TorchRunner
from nograd.runtime.speed.mode import Buckets
from nograd.runtime.speed.path import CudaGraphs, SpeedModePath
from tests.unit.runtime.speed.conftest import (
    CPU,
    Tiny,
    rows_of,
    tiny,
    tiny_config,
)


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: replay re-runs what was captured into the same
    static output tensors, which is what a real graph's kernels do."""

    instances: ClassVar[list[FakeGraph]] = []

    def __init__(self) -> None:
        self.replay_fn: Callable[[], None] | None = None
        self.replays = 0
        FakeGraph.instances.append(self)

    def replay(self) -> None:
        assert self.replay_fn is not None
        self.replays += 1
        self.replay_fn()


class FakeCuda:
    """The torch.cuda calls CudaGraphs makes, recorded."""

    def __init__(self) -> None:
        self.capturing: FakeGraph | None = None
        self.events: list[str] = []

    @contextmanager
    def graph(self, graph: FakeGraph, pool: object, capture_error_mode: str) -> Iterator[None]:
        assert capture_error_mode == "thread_local"
        self.events.append("capture")
        self.capturing = graph
        try:
            yield
        finally:
            self.capturing = None

    @contextmanager
    def stream(self, stream: object) -> Iterator[None]:
        self.events.append("side-stream")
        yield


class FakeStream:
    def __init__(self, device: object = None) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass


def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    FakeGraph.instances = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake.graph)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    return fake


def recording_forward(
    fake: FakeCuda, forward: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]
) -> Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]:
    """Runs ``forward``; under a fake capture, teaches the graph to redo it in place."""

    def run(batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        outputs = forward(batch)
        graph = fake.capturing
        if graph is not None:

            def replay() -> None:
                for name, tensor in forward(batch).items():
                    outputs[name].copy_(tensor)

            graph.replay_fn = replay
        return outputs

    return run


def test_cuda_graphs_capture_per_shape_and_replay_into_static_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = fake_cuda(monkeypatch)
    handler = tiny()
    path = SpeedModePath(handler, Buckets((2, 4)), frozenset(), None)
    forward = recording_forward(fake, path.eager_forward)
    graphs = CudaGraphs(torch.device("cuda", 0))
    with torch.inference_mode():
        small = handler.collate([rows_of(1, 2)])
        large = handler.collate([rows_of(1, 2, 3, 4)])
        graphs.capture(forward, [small, large, small])
        assert len(graphs) == 2, "one graph per shape"
        assert fake.events == ["side-stream", "capture"] * 2, "warm up on a side stream first"
        new = handler.collate([rows_of(7, 8)])
        replayed = graphs.replay(new)
        assert replayed is not None
        again = graphs.replay(handler.collate([rows_of(9, 10)]))
        assert again is replayed, "replay returns the captured (static) output buffers"
        np.testing.assert_allclose(
            again["y"].numpy(), handler.forward(handler.collate([rows_of(9, 10)]))["y"].numpy()
        )
        assert graphs.replay(handler.collate([rows_of(1, 2, 3)])) is None, "3 rows: not captured"
    assert sum(g.replays for g in FakeGraph.instances) == 2


def test_speed_path_replays_captured_shapes_and_runs_others_eagerly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = fake_cuda(monkeypatch)
    handler = tiny()
    path = SpeedModePath(handler, Buckets((2, 4)), frozenset(), None)
    handler.speed_path = path
    graphs = CudaGraphs(torch.device("cuda", 0))
    with torch.inference_mode():
        batches = [handler.collate([rows_of(*range(n))]) for n in (2, 4)]
        graphs.capture(recording_forward(fake, path.eager_forward), batches)
    path.graphs = graphs
    runner = TorchRunner(handler)
    result = runner.run_batch([rows_of(5, 6, 7)])[0]
    assert sum(g.replays for g in FakeGraph.instances) == 1, "3 rows padded to the 4-row graph"
    assert result["y"].shape == (3, 3)
    expected = ModelHandler(Tiny().eval(), tiny_config(), CPU)
    want = TorchRunner(expected).run_batch([rows_of(5, 6, 7)])[0]
    np.testing.assert_allclose(result["y"], want["y"], rtol=1e-6)
    handler.speed_path = SpeedModePath(handler, None, frozenset(), None)
    handler.speed_path.graphs = graphs
    runner.run_batch([rows_of(5, 6, 7)])
    assert sum(g.replays for g in FakeGraph.instances) == 1, "an uncaptured shape runs eager"
