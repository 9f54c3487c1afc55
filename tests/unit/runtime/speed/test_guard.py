"""The accuracy guard: comparisons, acceptance and refusal, speed timing, fallbacks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest
import torch

from nograd.observability.metrics import Metrics
from nograd.runtime.handler import TensorPart, TorchRunner
from nograd.runtime.speed import guard as speed
from nograd.runtime.speed.accuracy import compare
from nograd.runtime.speed.guard import (
    CheckBatch,
    apply_speed,
    check_batches,
    time_batches,
)
from nograd.runtime.speed.mode import mode_for
from nograd.serving.extensions.speed_checks import recorder
from tests.unit.runtime.speed.conftest import (
    CPU,
    REAL_COMPILE,
    Tiny,
    gauge,
    rows_of,
    scripted_timings,
    tiny,
)


def test_compare_reports_max_abs_error_min_cosine_and_match_rate() -> None:
    ref = {"y": np.array([[1.0, 0.0], [0.0, 2.0]], np.float32), "n": np.array([[1], [2]])}
    cand = {"y": np.array([[1.0, 0.1], [0.0, 1.9]], np.float32), "n": np.array([[1], [3]])}
    report = compare([ref], [cand])
    y, n = report.outputs
    assert y.max_abs_error == pytest.approx(0.1, rel=1e-5)
    assert y.min_cosine == pytest.approx(1 / np.sqrt(1.01), rel=1e-6)
    assert n.match_rate == 0.5 and n.max_abs_error is None
    assert report.problems(0.2, 0.99) == []
    problems = report.problems(0.05, 0.999)
    assert len(problems) == 2 and "accuracy_tolerance" in problems[0]
    assert "min_cosine" in problems[1]


def test_compare_treats_nan_as_a_failure_and_zero_rows_as_equal() -> None:
    ref = {"y": np.array([[0.0, 0.0], [1.0, 1.0]], np.float32)}
    nan = {"y": np.array([[0.0, 0.0], [np.nan, 1.0]], np.float32)}
    assert compare([ref], [ref]).min_cosine == pytest.approx(1.0)
    assert compare([ref], [ref]).max_abs_error == 0.0
    assert len(compare([ref], [nan]).problems(1.0, -1.0)) == 2
    mixed = compare([ref, ref], [nan, ref])
    assert np.isnan(mixed.max_abs_error) and np.isnan(mixed.min_cosine), "NaN is never dropped"
    assert np.isnan(compare([ref, ref], [ref, nan]).max_abs_error)


def test_bf16_within_tolerance_is_accepted_and_exported() -> None:
    metrics = Metrics()
    handler = apply_speed(tiny(precision="bf16"), limit=16, report_check=recorder(metrics))
    assert handler.speed_mode == "bf16"
    assert handler.compute_dtype == torch.bfloat16
    assert handler.module.linear.weight.dtype == torch.bfloat16
    delta = gauge(metrics, "nograd_model_accuracy_delta", "tiny", "bf16")
    cosine = gauge(metrics, "nograd_model_accuracy_cosine_min", "tiny", "bf16")
    assert delta is not None and 0 < delta < 1e-2
    assert cosine is not None and 0.999 < cosine <= 1.0
    outputs = TorchRunner(handler).run_batch([rows_of(1, 2)])[0]
    assert outputs["y"].dtype == np.float32, "outputs keep their declared datatype"


def test_beyond_tolerance_is_refused_and_fp32_weights_restored_exactly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    original = {k: v.clone() for k, v in Tiny().state_dict().items()}
    metrics = Metrics()
    with caplog.at_level(logging.WARNING, "nograd.runtime.speed.guard"):
        handler = apply_speed(
            tiny(precision="bf16", accuracy_tolerance=1e-6),
            limit=16,
            report_check=recorder(metrics),
        )
    assert handler.speed_mode == "fp32" and handler.speed_path is None
    assert handler.compute_dtype == torch.float32
    for name, tensor in handler.module.state_dict().items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name
    message = caplog.records[-1].getMessage()
    assert "speed mode bf16 refused, serving fp32 eager" in message
    assert "exceeds accuracy_tolerance 1e-06" in message
    delta = gauge(metrics, "nograd_model_accuracy_delta", "tiny", "bf16")
    assert delta is not None and delta > 1e-6, "the refused mode's delta is still exported"


def test_a_mode_slower_than_fp32_eager_is_refused_and_its_speed_exported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """bf16 casts pass the accuracy check on any CPU, and ran 4-7x slower than fp32 on one
    without native bf16: within tolerance is not enough to serve."""
    monkeypatch.setattr(speed, "time_batches", scripted_timings(0.010, 0.050))
    original = {k: v.clone() for k, v in Tiny().state_dict().items()}
    metrics = Metrics()
    with caplog.at_level(logging.WARNING, "nograd.runtime.speed.guard"):
        handler = apply_speed(tiny(precision="bf16"), limit=16, report_check=recorder(metrics))
    assert handler.speed_mode == "fp32" and handler.compute_dtype == torch.float32
    for name, tensor in handler.module.state_dict().items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name
    message = caplog.records[-1].getMessage()
    assert "speed mode bf16 refused, serving fp32 eager: 0.20x fp32 eager's speed" in message
    assert "(50 ms against fp32 eager's 10 ms" in message and "under min_speedup 0.9" in message
    assert "max abs error" in message, "the accuracy it did have is still reported"
    assert gauge(metrics, "nograd_model_speedup", "tiny", "bf16") == pytest.approx(0.2)
    assert gauge(metrics, "nograd_model_accuracy_delta", "tiny", "bf16") is not None


def test_a_faster_mode_is_accepted_with_its_speed_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(speed, "time_batches", scripted_timings(0.030, 0.010))
    metrics = Metrics()
    with caplog.at_level(logging.INFO, "nograd.runtime.speed.guard"):
        handler = apply_speed(tiny(precision="bf16"), limit=16, report_check=recorder(metrics))
    assert handler.speed_mode == "bf16"
    message = caplog.records[-1].getMessage()
    assert "speed mode bf16 accepted" in message and "3.00x fp32 eager's speed" in message
    assert gauge(metrics, "nograd_model_speedup", "tiny", "bf16") == pytest.approx(3.0)


def test_min_speedup_is_the_bar_and_zero_turns_the_timing_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(speed, "time_batches", scripted_timings(0.012, 0.010))
    assert apply_speed(tiny(precision="bf16", min_speedup=1.5), limit=16).speed_mode == "fp32"
    monkeypatch.setattr(speed, "time_batches", scripted_timings())  # any call fails
    metrics = Metrics()
    with caplog.at_level(logging.INFO, "nograd.runtime.speed.guard"):
        handler = apply_speed(
            tiny(precision="bf16", min_speedup=0), limit=16, report_check=recorder(metrics)
        )
    assert handler.speed_mode == "bf16"
    assert "speed not checked (min_speedup 0)" in caplog.records[-1].getMessage()
    assert gauge(metrics, "nograd_model_speedup", "tiny", "bf16") is None


def test_a_mode_refused_for_accuracy_is_not_timed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(speed, "time_batches", scripted_timings(0.010))  # fp32 eager's only
    with caplog.at_level(logging.WARNING, "nograd.runtime.speed.guard"):
        handler = apply_speed(tiny(precision="bf16", accuracy_tolerance=1e-6), limit=16)
    assert handler.speed_mode == "fp32"
    message = caplog.records[-1].getMessage()
    assert "exceeds accuracy_tolerance" in message and "fp32 eager's speed" not in message


class ClockedRunner:
    """A runner whose n-th ``run_batch`` takes ``durations[n]`` seconds on a fake clock."""

    def __init__(self, durations: list[float]) -> None:
        self.now = 0.0
        self.durations = iter(durations)
        self.calls = 0

    def clock(self) -> float:
        return self.now

    def run_batch(self, parts: list[TensorPart]) -> list[dict[str, np.ndarray]]:
        self.calls += 1
        self.now += next(self.durations)
        return [{} for _ in parts]


def test_time_batches_keeps_each_batch_at_its_fastest_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batches = [CheckBatch("warmup", rows_of(1)), CheckBatch("warmup", rows_of(1, 2))]
    runner = ClockedRunner([3, 5, 2, 6, 4, 4])  # pass by pass, batch by batch
    monkeypatch.setattr(speed.time, "perf_counter", runner.clock)
    assert time_batches(cast(TorchRunner, runner), batches) == (2, 4)
    assert runner.calls == 6


def test_time_batches_gives_up_after_a_pass_already_too_slow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batches = [CheckBatch("warmup", rows_of(1)), CheckBatch("warmup", rows_of(1, 2))]
    runner = ClockedRunner([5, 5, 1, 1, 1, 1])
    monkeypatch.setattr(speed.time, "perf_counter", runner.clock)
    assert time_batches(cast(TorchRunner, runner), batches, give_up_above=7) == (5, 5)
    assert runner.calls == 2, "one pass over the batches, then it stopped"


def test_time_batches_times_a_real_forward() -> None:
    handler = tiny()
    batches = check_batches(handler, mode_for(handler.config, CPU), limit=16)
    seconds = time_batches(TorchRunner(handler), batches, passes=2)
    assert len(seconds) == len(batches) and all(0 < s < 5 for s in seconds)


def lossy_compile(noise: float) -> Callable[..., torch.nn.Module]:
    """A fake torch.compile whose model is off by ``noise``: a deliberately lossy mode."""

    class Lossy(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
            out = dict(self.inner(**inputs))
            out["y"] = out["y"] + noise
            return out

    def fake(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
        del options
        return Lossy(model)

    return fake


def test_lossy_mode_is_refused_and_the_eager_module_serves(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch, "compile", lossy_compile(1e-3))
    handler = tiny(compile=True)
    module = handler.module
    with caplog.at_level(logging.WARNING, "nograd.runtime.speed.guard"):
        served = apply_speed(handler, limit=16, report_check=recorder(Metrics()))
    assert served.module is module and served.speed_mode == "fp32"
    assert "speed mode compile refused" in caplog.text
    assert "max abs error 0.001 exceeds accuracy_tolerance 0.0001" in caplog.text


def test_small_noise_within_a_configured_tolerance_is_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "compile", lossy_compile(1e-3))
    served = apply_speed(tiny(compile=True, accuracy_tolerance=2e-3), limit=16)
    assert served.speed_mode == "compile"


def test_compile_that_raises_falls_back_to_fp32_eager(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
        raise RuntimeError("InductorError: no working C++ compiler\nlong traceback")

    monkeypatch.setattr(torch, "compile", broken)
    handler = tiny(precision="bf16", compile=True, compile_buckets=(1, 8))
    metrics = Metrics()
    with caplog.at_level(logging.WARNING, "nograd.runtime.speed.guard"):
        served = apply_speed(handler, limit=8, report_check=recorder(metrics))
    assert served.speed_mode == "fp32" and served.speed_path is None
    assert served.compute_dtype == torch.float32
    assert served.module.linear.weight.dtype == torch.float32
    line = caplog.records[-1].getMessage()
    assert "speed mode bf16+compile refused, serving fp32 eager: building it failed" in line
    assert "RuntimeError: InductorError: no working C++ compiler" in line
    assert "long traceback" not in line, "one line, the first line of the error"
    assert gauge(metrics, "nograd_model_accuracy_delta", "tiny", "bf16+compile") is None
    out = TorchRunner(served).run_batch([rows_of(1, 2, 3)])[0]
    assert out["y"].shape == (3, 3)


def test_compile_that_fails_on_first_call_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    class FailsLazily(torch.nn.Module):
        def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("backend compiler failed")

    monkeypatch.setattr(torch, "compile", lambda model, **options: FailsLazily())
    handler = tiny(compile=True)
    module = handler.module
    served = apply_speed(handler, limit=8)
    assert served.module is module and served.speed_mode == "fp32"


def test_real_dynamo_compile_with_buckets_never_recompiles_under_traffic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dynamo traces for real (backend ``eager`` skips inductor's C++ build, to stay fast)."""
    compiled_shapes: list[tuple[int, ...]] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiled_shapes.append(tuple(example_inputs[-1].shape))
        return gm.forward

    options_seen: dict[str, Any] = {}

    def compile_eager(model: torch.nn.Module, **options: Any) -> Any:
        options_seen.update(options)
        return REAL_COMPILE(model, backend=counting_backend, **options)

    monkeypatch.setattr(torch, "compile", compile_eager)
    metrics = Metrics()
    handler = apply_speed(
        tiny(compile=True, compile_buckets=(1, 4, 8)), limit=8, report_check=recorder(metrics)
    )
    assert handler.speed_mode == "compile"
    assert options_seen["dynamic"] is False and options_seen["mode"] == "default"
    assert options_seen.get("recompile_limit", 3) == 3
    assert len(compiled_shapes) == 3, compiled_shapes
    runner = TorchRunner(handler)
    for rows in (2, 3, 5, 7, 1, 20, 8):
        out = runner.run_batch([rows_of(*range(rows))])[0]
        assert out["y"].shape == (rows, 3)
    assert len(compiled_shapes) == 3, "traffic triggered a recompile"
    delta = gauge(metrics, "nograd_model_accuracy_delta", "tiny", "compile")
    assert delta is not None and delta <= 1e-6


def test_autocast_mode_keeps_fp32_weights_and_runs_low_precision() -> None:
    handler = apply_speed(tiny(precision="bf16", autocast=True), limit=8)
    assert handler.speed_mode == "bf16-autocast"
    assert handler.module.linear.weight.dtype == torch.float32
    assert handler.compute_dtype == torch.float32
    assert handler.speed_path is not None
    with torch.inference_mode():
        batch = handler.collate([rows_of(1)])
        assert handler.speed_path.forward(batch)["y"].dtype == torch.bfloat16


def test_fp32_eager_config_is_left_alone() -> None:
    handler = tiny()
    module = handler.module
    assert apply_speed(handler, limit=8) is handler
    assert handler.module is module and handler.speed_path is None
