"""Memory measurement, cost models and budget planning (CPU only, fast)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nograd.runtime.memory import (
    UNBOUNDED_ROWS,
    CostModel,
    CpuMemoryProbe,
    CudaMemoryProbe,
    LiveTensorTracker,
    MemoryProbe,
    PlanRow,
    batch_limit,
    device_budget,
    fit_cost_model,
    format_bytes,
    format_plan,
    is_out_of_memory,
    probe_for,
    profile_forward,
    share_budget,
)

FLOAT32 = 4

# ---------------------------------------------------------------------------------------------
# LiveTensorTracker
# ---------------------------------------------------------------------------------------------


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
    model = _mlp()
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


# ---------------------------------------------------------------------------------------------
# Measured costs of real forwards
# ---------------------------------------------------------------------------------------------

MLP_WIDTHS = (512, 1024, 1024, 10)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(MLP_WIDTHS[0], MLP_WIDTHS[1]),
        torch.nn.ReLU(),
        torch.nn.Linear(MLP_WIDTHS[1], MLP_WIDTHS[2]),
        torch.nn.ReLU(),
        torch.nn.Linear(MLP_WIDTHS[2], MLP_WIDTHS[3]),
    ).eval()


def _analytic_mlp_peak_per_sample() -> int:
    """Peak live activation bytes per sample of ``_mlp`` under inference mode.

    Without autograd nothing is saved for backward: ``nn.Sequential`` rebinds its ``input``
    after each layer, so a layer's input dies as soon as its output exists.  While a layer
    runs, its input and output are alive together; the batch itself stays alive throughout
    because the caller (``run``) holds it.  Activations per sample, in order:
    x=512, linear1=1024, relu=1024, linear2=1024, relu=1024, linear3=10.
    Live floats at each step: x+1024, x+1024+1024, x+1024+1024, x+1024+1024, x+1024+10.
    Peak = 512 + 2 * 1024 = 2560 floats = 10240 bytes.
    """
    acts = [MLP_WIDTHS[0]]
    for width in MLP_WIDTHS[1:]:
        acts += [width, width]  # Linear output, then ReLU output (last layer has no ReLU)
    acts = acts[:-1]
    batch = acts[0]
    steps = [batch + (acts[i - 1] if i > 1 else 0) + acts[i] for i in range(1, len(acts))]
    return max(steps) * FLOAT32


def test_mlp_per_sample_cost_matches_analytic_activations() -> None:
    model = _mlp()

    def run(rows: int, length: int) -> torch.Tensor:
        with torch.inference_mode():
            out: torch.Tensor = model(torch.randn(rows, MLP_WIDTHS[0]))
            return out

    analytic = _analytic_mlp_peak_per_sample()
    assert analytic == 10240
    profile = profile_forward(run, CpuMemoryProbe(), rows=(8, 16, 32, 64))

    assert profile.model.per_unit == pytest.approx(analytic, rel=0.2)
    assert profile.model.quadratic == 0.0
    assert profile.relative_error < 0.05
    # Weights (~5.3 MB) exist before the forward and must not be billed to it.
    assert profile.model.fixed < analytic


def _attention(rows: int, length: int, dim: int = 32) -> torch.Tensor:
    with torch.inference_mode():
        x = torch.randn(rows, length, dim)
        return torch.softmax(x @ x.transpose(1, 2), dim=-1) @ x


def test_sequence_model_quadratic_fit_predicts_check_point() -> None:
    profile = profile_forward(
        _attention,
        CpuMemoryProbe(),
        rows=(2, 4, 8),
        lengths=(16, 32, 64),
        check=(12, 96),
        quadratic=True,
    )
    assert profile.check_point.rows == 12
    assert profile.check_point.length == 96
    assert profile.relative_error < 0.25
    # Scores and softmax are both n*L*L floats alive together: ~8 bytes per n*L^2.
    assert profile.model.quadratic == pytest.approx(2 * FLOAT32, rel=0.25)
    # Without the quadratic term the same grid extrapolates badly in length.
    linear_only = fit_cost_model(profile.points, quadratic=False)
    assert abs(linear_only.predict(12, 96) - profile.check_point.measured_bytes) > abs(
        profile.check_point.predicted_bytes - profile.check_point.measured_bytes
    )


def test_profile_rejects_check_point_inside_grid() -> None:
    with pytest.raises(ValueError, match="check point"):
        profile_forward(_attention, CpuMemoryProbe(), rows=(2, 4), lengths=(8,), check=(4, 8))


def test_profile_default_check_is_beyond_the_grid() -> None:
    profile = profile_forward(lambda n, _: torch.empty(n, 256), CpuMemoryProbe(), rows=(1, 2, 4))
    assert (profile.check_point.rows, profile.check_point.length) == (6, 1)
    assert profile.model.per_unit == pytest.approx(256 * FLOAT32)
    assert profile.relative_error == pytest.approx(0.0, abs=1e-9)


# ---------------------------------------------------------------------------------------------
# Cost model
# ---------------------------------------------------------------------------------------------


def test_fit_recovers_linear_coefficients() -> None:
    points = [(n, 1, 4096 + 300 * n) for n in (1, 2, 4, 8, 16)]
    model = fit_cost_model(points, quadratic=False)
    assert model.fixed == pytest.approx(4096)
    assert model.per_unit == pytest.approx(300)
    assert model.quadratic == 0.0


def test_fit_recovers_quadratic_coefficients() -> None:
    def cost(n: int, length: int) -> int:
        return 2048 + 64 * n * length + 8 * n * length * length

    points = [(n, length, cost(n, length)) for n in (1, 2, 4) for length in (8, 16, 32, 64)]
    model = fit_cost_model(points, quadratic=True)
    assert model.fixed == pytest.approx(2048, rel=1e-6)
    assert model.per_unit == pytest.approx(64, rel=1e-6)
    assert model.quadratic == pytest.approx(8, rel=1e-6)
    assert model.predict(16, 128) == pytest.approx(cost(16, 128))


def test_fit_never_returns_negative_coefficients() -> None:
    # A negative intercept is an artefact (e.g. a reused buffer); clamping must refit slope.
    points = [(n, 1, 100 * n - 50) for n in (2, 4, 8)]
    model = fit_cost_model(points, quadratic=False)
    assert model.fixed == 0.0
    assert 90 < model.per_unit < 100


def test_fit_needs_two_lengths_for_quadratic() -> None:
    with pytest.raises(ValueError, match="two lengths"):
        fit_cost_model([(1, 8, 100), (2, 8, 200), (4, 8, 400)], quadratic=True)


def test_cost_model_rejects_negative_coefficients() -> None:
    with pytest.raises(ValueError):
        CostModel(fixed=-1.0, per_unit=1.0)


def test_max_rows_boundaries() -> None:
    model = CostModel(fixed=100.0, per_unit=10.0)
    assert model.max_rows(109) == 0
    assert model.max_rows(110) == 1
    assert model.max_rows(169) == 6
    assert model.max_rows(170) == 7
    assert model.predict(7) == 170
    # Awkward floats must still give the exact answer.
    tricky = CostModel(fixed=0.0, per_unit=0.1)
    assert tricky.max_rows(0.3) == max(n for n in range(10) if tricky.predict(n) <= 0.3)


def test_max_rows_is_monotone_in_budget() -> None:
    model = CostModel(fixed=1000.0, per_unit=37.0, quadratic=3.0)
    limits = [model.max_rows(budget, length=5) for budget in range(0, 20000, 7)]
    assert limits == sorted(limits)
    for budget, limit in zip(range(0, 20000, 7), limits, strict=True):
        assert limit == 0 or model.predict(limit, 5) <= budget
        assert model.predict(limit + 1, 5) > budget


def test_max_tokens_and_length_scaling() -> None:
    model = CostModel(fixed=0.0, per_unit=1.0, quadratic=1.0)
    assert model.per_row(4) == 4 + 16
    assert model.max_rows(200, length=4) == 10
    assert model.max_tokens(200, length=4) == 40
    assert model.max_rows(200, length=8) < model.max_rows(200, length=4)


def test_max_rows_without_per_row_cost_is_unbounded() -> None:
    assert CostModel(fixed=10.0, per_unit=0.0).max_rows(10) == UNBOUNDED_ROWS
    assert CostModel(fixed=10.0, per_unit=0.0).max_rows(9) == 0


def test_batch_limit() -> None:
    model = CostModel(fixed=0.0, per_unit=1000.0)
    assert batch_limit(model, share_bytes=1_000_000, max_batch_size=32) == 32
    assert batch_limit(model, share_bytes=10_500, max_batch_size=32) == 10
    assert batch_limit(model, share_bytes=999, max_batch_size=32) == 0
    seq = CostModel(fixed=0.0, per_unit=10.0, quadratic=1.0)
    assert batch_limit(seq, share_bytes=200 * 15 + 199, max_batch_size=64, length=10) == 15


# ---------------------------------------------------------------------------------------------
# Probes
# ---------------------------------------------------------------------------------------------


class FakeCuda:
    """Caching-allocator counters standing in for torch.cuda."""

    def __init__(self) -> None:
        self.allocated = 1000
        self.peak = 1000
        self.reserved = 4000
        self.calls: list[str] = []

    def alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def record(name: str, result: Callable[[], object]) -> Callable[..., object]:
            def fake(*args: object, **kwargs: object) -> object:
                self.calls.append(name)
                return result()

            return fake

        def reset() -> None:
            self.peak = self.allocated

        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", record("synchronize", lambda: None))
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", record("reset", reset))
        monkeypatch.setattr(cuda, "memory_allocated", record("allocated", lambda: self.allocated))
        monkeypatch.setattr(cuda, "max_memory_allocated", record("peak", lambda: self.peak))
        monkeypatch.setattr(cuda, "memory_reserved", record("reserved", lambda: self.reserved))
        monkeypatch.setattr(cuda, "mem_get_info", record("info", lambda: (10_000, 80_000)))
        monkeypatch.setattr(cuda, "empty_cache", record("empty_cache", lambda: None))
        monkeypatch.setattr(
            cuda,
            "get_device_properties",
            record("props", lambda: SimpleNamespace(total_memory=80_000)),
        )


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    fake = FakeCuda()
    fake.install(monkeypatch)
    yield fake


def test_cuda_probe_measures_peak_delta(fake_cuda: FakeCuda) -> None:
    probe = CudaMemoryProbe(torch.device("cuda", 0))
    fake_cuda.alloc(5000)  # an earlier peak that must not leak into the measurement

    def forward() -> str:
        fake_cuda.alloc(300)  # batch
        fake_cuda.alloc(700)  # activation
        fake_cuda.alloc(-700)
        return "output"

    assert probe.measure_peak(forward) == 1000
    calls = fake_cuda.calls
    assert calls.index("synchronize") < calls.index("reset") < calls.index("allocated")
    assert calls.count("synchronize") == 2
    assert calls[-1] == "peak"

    probe.release_cache()
    assert fake_cuda.calls[-1] == "empty_cache"


def test_cuda_probe_readings(fake_cuda: FakeCuda) -> None:
    probe = probe_for(torch.device("cuda", 0))
    assert isinstance(probe, CudaMemoryProbe)
    assert isinstance(probe, MemoryProbe)
    assert probe.device == "cuda:0"
    assert probe.total_bytes() == 80_000
    assert probe.allocated_bytes() == 1000
    assert probe.reserved_bytes() == 4000
    # Driver-free memory plus what our caching allocator holds but is not using.
    assert probe.available_bytes() == 10_000 + (4000 - 1000)


def test_probe_for_rejects_unknown_devices() -> None:
    assert isinstance(probe_for(torch.device("cpu")), CpuMemoryProbe)
    with pytest.raises(ValueError):
        probe_for(torch.device("meta"))
    with pytest.raises(ValueError):
        CudaMemoryProbe(torch.device("cpu"))


def test_cpu_probe_reads_this_machine() -> None:
    probe = CpuMemoryProbe()
    assert isinstance(probe, MemoryProbe)
    assert probe.device == "cpu"
    assert 0 < probe.available_bytes() <= probe.total_bytes()
    assert probe.allocated_bytes() > 10 * 2**20  # torch alone is tens of MB resident
    assert probe.measure_peak(lambda: torch.empty(1024, dtype=torch.uint8)) == 1024


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cpu_probe_meminfo_without_cgroup_limit(tmp_path: Path) -> None:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "meminfo", "MemTotal:  1000 kB\nMemFree: 10 kB\nMemAvailable:  600 kB\n")
    _write(proc / "self" / "cgroup", "0::/\n")
    _write(cgroup / "memory.max", "max\n")
    probe = CpuMemoryProbe(proc_root=proc, cgroup_root=cgroup)
    assert probe.total_bytes() == 1000 * 1024
    assert probe.available_bytes() == 600 * 1024


def test_cpu_probe_honours_cgroup_v2_limit(tmp_path: Path) -> None:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "meminfo", "MemTotal: 64000000 kB\nMemAvailable: 60000000 kB\n")
    _write(proc / "self" / "cgroup", "0::/\n")
    _write(cgroup / "memory.max", f"{4 * 2**30}\n")
    _write(cgroup / "memory.current", f"{3 * 2**30}\n")
    _write(cgroup / "memory.stat", f"anon 123\ninactive_file {2**29}\n")
    probe = CpuMemoryProbe(proc_root=proc, cgroup_root=cgroup)
    assert probe.total_bytes() == 4 * 2**30
    # Inactive page cache is reclaimable, so it counts as available.
    assert probe.available_bytes() == 4 * 2**30 - (3 * 2**30 - 2**29)


def test_cpu_probe_honours_nested_cgroup_v1_limit(tmp_path: Path) -> None:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "meminfo", "MemTotal: 64000000 kB\nMemAvailable: 60000000 kB\n")
    _write(proc / "self" / "cgroup", "5:memory:/pod/abc\n0::/\n")
    _write(cgroup / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    own = cgroup / "memory" / "pod" / "abc"
    _write(own / "memory.limit_in_bytes", f"{2**30}\n")
    _write(own / "memory.usage_in_bytes", f"{2**28}\n")
    _write(own / "memory.stat", "cache 1\ntotal_inactive_file 0\n")
    probe = CpuMemoryProbe(proc_root=proc, cgroup_root=cgroup)
    assert probe.total_bytes() == 2**30
    assert probe.available_bytes() == 2**30 - 2**28


# ---------------------------------------------------------------------------------------------
# Budgets and plan
# ---------------------------------------------------------------------------------------------


class FixedProbe:
    device = "cpu"

    def __init__(self, available: int) -> None:
        self.available = available

    def total_bytes(self) -> int:
        return self.available * 2

    def available_bytes(self) -> int:
        return self.available

    def allocated_bytes(self) -> int:
        return 0

    def measure_peak(self, fn: Callable[[], object]) -> int:
        fn()
        return 0

    def release_cache(self) -> None:
        pass


def test_device_budget() -> None:
    probe = FixedProbe(available=1000)
    assert device_budget(probe, fraction=0.9, explicit_bytes=None) == 900
    assert device_budget(probe, fraction=0.9, explicit_bytes=12345) == 12345
    with pytest.raises(ValueError):
        device_budget(probe, fraction=0.0, explicit_bytes=None)
    with pytest.raises(ValueError):
        device_budget(probe, fraction=1.5, explicit_bytes=None)


def test_share_budget() -> None:
    shares = share_budget(1000, {"a": 1.0, "b": 3.0})
    assert shares == {"a": 250, "b": 750}
    uneven = share_budget(1001, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert sum(uneven.values()) <= 1001
    assert max(uneven.values()) - min(uneven.values()) <= 1
    assert share_budget(90, {"a": 0.0, "b": 0.0}) == {"a": 45, "b": 45}
    assert share_budget(90, {}) == {}
    weights = {f"m{i}": float(i * 7 % 5) for i in range(11)}
    assert sum(share_budget(10**9 + 7, weights).values()) <= 10**9 + 7
    with pytest.raises(ValueError):
        share_budget(100, {"a": -1.0})


def test_format_plan() -> None:
    table = format_plan(
        [
            PlanRow("resnet", "cuda:0", 97_800_000, 10240.0, 64, 2 * 2**30),
            PlanRow("minilm", "cpu", 90_000_000, 1536.0, 4096, 512 * 2**20, unit="token"),
        ]
    )
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[0].split() == ["model", "device", "weights", "per", "unit", "limit", "budget"]
    assert set(lines[1]) <= {"-", " "}
    assert "resnet" in lines[2] and "10.0 KiB/sample" in lines[2] and "2.0 GiB" in lines[2]
    assert "1.5 KiB/token" in lines[3] and "4096" in lines[3]
    # Right-aligned numeric columns end at the same offset.
    assert lines[2].index("64") + 2 == lines[3].index("4096") + 4


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**40) == "3.0 TiB"


# ---------------------------------------------------------------------------------------------
# Out-of-memory classification
# ---------------------------------------------------------------------------------------------


def test_is_out_of_memory() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 1099511627776 bytes. Error code 12"
        )
    )
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: not enough memory: you tried"))
    assert not is_out_of_memory(ValueError("not enough memory"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_is_out_of_memory_real_cpu_allocation_failure() -> None:
    # 32 PiB exceeds any x86-64/arm64 address space, so this fails even with overcommit.
    with pytest.raises(RuntimeError) as info:
        torch.empty(1 << 55, dtype=torch.uint8)
    assert is_out_of_memory(info.value)


def test_is_out_of_memory_follows_explicit_cause() -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory")
    try:
        try:
            raise oom
        except torch.OutOfMemoryError as exc:
            raise ValueError("model failed") from exc
    except ValueError as wrapped:
        assert is_out_of_memory(wrapped)
