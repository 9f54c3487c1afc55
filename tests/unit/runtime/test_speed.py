"""Speed modes (nograd/runtime/speed/): buckets, padding, the accuracy guard and its fallbacks.

Everything here runs on CPU. torch.compile is either monkeypatched (to raise, or to perturb the
outputs) or run with dynamo's ``eager`` backend, which traces for real but skips inductor's C++
compile, so the default run stays fast. CUDA graphs are driven through fakes of the torch.cuda
pieces they use: capture and replay bookkeeping is checked; kernels are not (that needs a GPU).
The speed check's timing is replaced by a fake that times every mode as fast as fp32 eager
(autouse), so whether a mode is accepted for its accuracy does not depend on this machine's CPU;
the speed check's own tests script the timings.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
import pytest
import torch

from nograd.observability.metrics import Metrics
from nograd.runtime.config import ConfigError, ModelConfig, TensorSpec, load_config
from nograd.runtime.handler import ModelHandler, TensorPart, TorchRunner, _pad_concat, chunk_rows
from nograd.runtime.loader import build_handler
from nograd.runtime.speed import guard as speed
from nograd.runtime.speed.accuracy import compare
from nograd.runtime.speed.guard import (
    CheckBatch,
    apply_speed,
    check_batches,
    sequence_inputs,
    time_batches,
)
from nograd.runtime.speed.mode import Buckets, mode_for, next_bucket
from nograd.runtime.speed.path import CudaGraphs, SpeedModePath, batch_cap
from nograd.serving.dataplane import DataPlane
from nograd.serving.speed_checks import load_accuracy_sample, recorder
from nograd.settings import Settings

CPU = torch.device("cpu")
REAL_COMPILE = torch.compile


# ------------------------------------------------------------------------------ tiny models
class Tiny(torch.nn.Module):
    """A float output and an integer one, so both comparisons are exercised."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.linear(x) * self.scale
        return {"y": y, "label": torch.argmax(y, dim=1, keepdim=True)}


class RecordingTiny(Tiny):
    """Tiny that records the batch shapes it is called with (eager only)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.shapes.append(tuple(x.shape))
        return super().forward(x)


class TinyText(torch.nn.Module):
    """A token model: embeddings mean-pooled over the mask."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 5)
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(ids.shape))
        weights = mask.unsqueeze(-1).to(torch.float32)
        summed = (self.embed(ids).to(torch.float32) * weights).sum(dim=1)
        return summed / weights.sum(dim=1).clamp(min=1.0)


def tiny_config(**levers: Any) -> ModelConfig:
    return ModelConfig(
        name="tiny",
        weights=None,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(4,)),),
        outputs=(
            TensorSpec(name="y", datatype="FP32", shape=(3,)),
            TensorSpec(name="label", datatype="INT64", shape=(1,)),
        ),
        **levers,
    )


def text_config(**levers: Any) -> ModelConfig:
    return ModelConfig(
        name="text",
        weights=None,
        batch_unit="tokens",
        inputs=(
            TensorSpec(name="ids", datatype="INT64", shape=(-1,)),
            TensorSpec(name="mask", datatype="INT64", shape=(-1,)),
        ),
        outputs=(TensorSpec(name="pooled", datatype="FP32", shape=(5,)),),
        **levers,
    )


class TextHandler(ModelHandler):
    """Masks that are all ones, as a tokenizer would give for unpadded texts."""

    def example(self, rows: int, length: int = 1, seed: int = 0) -> TensorPart:
        ids = np.random.default_rng(seed).integers(1, 16, size=(rows, length))
        mask = np.ones((rows, length), dtype=np.int64)
        return TensorPart({"ids": ids.astype(np.int64), "mask": mask}, rows, length)


def tiny(**levers: Any) -> ModelHandler:
    return ModelHandler(Tiny().eval(), tiny_config(**levers), CPU)


def recording() -> ModelHandler:
    return ModelHandler(RecordingTiny().eval(), tiny_config(), CPU)


def text(**levers: Any) -> TextHandler:
    return TextHandler(TinyText().eval(), text_config(**levers), CPU)


def rows_of(*values: float) -> TensorPart:
    x = np.array([[v, v + 1, v + 2, v + 3] for v in values], dtype=np.float32)
    return TensorPart({"x": x}, len(values))


def gauge(metrics: Metrics, name: str, model: str, mode: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model": model, "mode": mode})


def scripted_timings(*totals: float) -> Callable[..., tuple[float, ...]]:
    """A stand-in for ``time_batches``: its n-th call times every batch at ``totals[n]`` / count
    (the first call times fp32 eager, the second the mode); more calls fail the test, through
    ``pytest.fail``, which the guard's fallback (``except Exception``) cannot swallow."""
    calls = iter(totals)

    def fake(
        runner: TorchRunner, batches: list[CheckBatch], passes: int = 3, give_up_above: float = 0.0
    ) -> tuple[float, ...]:
        del runner, passes, give_up_above
        total = next(calls, None)
        if total is None:
            pytest.fail(f"time_batches called more than the {len(totals)} times scripted")
        return tuple(total / len(batches) for _ in batches)

    return fake


@pytest.fixture(autouse=True)
def every_mode_as_fast_as_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(speed, "time_batches", lambda _runner, batches, **_: (1e-3,) * len(batches))


# ------------------------------------------------------------------------------ buckets
def test_next_bucket_is_the_smallest_that_holds_the_batch() -> None:
    assert next_bucket((1, 8, 32), 1) == 1
    assert next_bucket((1, 8, 32), 2) == 8
    assert next_bucket((1, 8, 32), 8) == 8
    assert next_bucket((1, 8, 32), 9) == 32
    assert next_bucket((1, 8, 32), 33) == 33, "above every bucket: left alone (chunked instead)"


def test_bucket_shapes_and_fit() -> None:
    buckets = Buckets((1, 4), (16, 64))
    assert buckets.shapes() == [(1, 16), (4, 16), (1, 64), (4, 64)]
    assert buckets.fit(3, 10) == (4, 16)
    assert buckets.fit(1, 17) == (1, 64)
    assert buckets.fit(2, 100) == (4, 100), "too long for every length bucket: unpadded"
    assert Buckets((2, 8)).fit(5, 1) == (8, 1)


def test_chunk_rows_slices_parts_where_a_chunk_fills() -> None:
    parts = [rows_of(1, 2, 3), rows_of(4, 5), rows_of(6, 7, 8, 9, 10)]
    chunks = chunk_rows(parts, 4)
    assert [[p.rows for p in chunk] for chunk in chunks] == [[3, 1], [1, 3], [2]]
    flat = np.concatenate([p.tensors["x"][:, 0] for chunk in chunks for p in chunk])
    assert flat.tolist() == list(range(1, 11))


def test_pad_concat_pads_rows_and_only_the_sequence_axis_asked_for() -> None:
    a = np.ones((2, 3), dtype=np.int64)
    b = np.full((1, 5), 2, dtype=np.int64)
    out = _pad_concat([a, b], rows=4, length=8)
    assert tuple(out.shape) == (4, 8)
    assert out[:2, :3].eq(1).all() and out[2, :5].eq(2).all()
    assert out[3].eq(0).all() and out[:2, 3:].eq(0).all(), "padding must be zeros"
    single = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert _pad_concat([single]).tolist() == single.tolist()
    padded = _pad_concat([single], rows=8)
    assert tuple(padded.shape) == (8, 4) and padded[2:].eq(0).all()


def test_bucketed_run_pads_rows_and_slices_them_off() -> None:
    handler = recording()
    reference = TorchRunner(handler).run_batch([rows_of(1, 2, 3), rows_of(4)])
    module = handler.module
    assert isinstance(module, RecordingTiny)
    module.shapes.clear()
    handler.speed_path = SpeedModePath(handler, Buckets((1, 2, 8)), frozenset(), None)
    runner = TorchRunner(handler)
    results = runner.run_batch([rows_of(1, 2, 3), rows_of(4)])
    assert module.shapes == [(8, 4)], "a 4-row batch runs as the 8-row bucket"
    assert [r["y"].shape[0] for r in results] == [3, 1]
    for got, want in zip(results, reference, strict=True):
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-6)
        assert got["label"].tolist() == want["label"].tolist()
    module.shapes.clear()
    big = runner.run_batch([rows_of(*range(19))])
    assert module.shapes == [(8, 4), (8, 4), (8, 4)], "above the largest bucket: chunks of 8"
    assert big[0]["y"].shape == (19, 3)


def test_token_batches_pad_rows_and_length_to_buckets() -> None:
    handler = text()
    parts = [handler.example(2, 5), handler.example(1, 9, seed=3)]
    reference = TorchRunner(handler).run_batch(parts)
    assert sequence_inputs(handler) == frozenset({"ids", "mask"})
    handler.speed_path = SpeedModePath(
        handler, Buckets((4,), (8, 16)), sequence_inputs(handler), None
    )
    module = handler.module
    assert isinstance(module, TinyText)
    module.shapes.clear()
    results = TorchRunner(handler).run_batch(parts)
    assert module.shapes == [(4, 16)]
    for got, want in zip(results, reference, strict=True):
        np.testing.assert_allclose(got["pooled"], want["pooled"], rtol=1e-6)


def test_batch_cap_is_the_largest_bucket_in_the_model_unit() -> None:
    handler = tiny()
    assert batch_cap(handler) is None
    handler.speed_path = SpeedModePath(handler, Buckets((1, 8, 32)), frozenset(), None)
    assert batch_cap(handler) == 32
    tokens = text()
    tokens.speed_path = SpeedModePath(tokens, Buckets((1, 8), (64, 128)), frozenset({"ids"}), None)
    assert batch_cap(tokens) == 8 * 128


def test_held_out_inputs_differ_from_warmup_and_sit_off_the_buckets() -> None:
    handler = tiny(compile=True, compile_buckets=(1, 8))
    plan = mode_for(handler.config, CPU)
    batches = check_batches(handler, plan, limit=8)
    warm = [b.part for b in batches if b.kind == "warmup"]
    held = [b.part for b in batches if b.kind == "held-out"]
    assert [p.rows for p in warm] == [1, 8]
    assert [p.rows for p in held] == [3, 8, 12], "off-bucket, and one above the largest"
    assert not np.array_equal(held[1].tensors["x"], warm[1].tensors["x"]), "another seed"


# ------------------------------------------------------------------------------ the guard
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


# ------------------------------------------------------------------------------ plan and config
def test_max_autotune_leaves_cuda_graphs_to_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    from nograd.runtime.speed.guard import _compile

    seen: dict[str, Any] = {}

    def record(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
        seen.update(options)
        return model

    monkeypatch.setattr(torch, "compile", record)
    config = tiny_config(
        compile=True, compile_mode="max-autotune", cuda_graphs=True, compile_buckets=(1, 8)
    )
    _compile(Tiny(), mode_for(config, torch.device("cuda", 0)), warm_shapes=2)
    assert seen["mode"] == "max-autotune-no-cudagraphs" and seen["dynamic"] is False
    _compile(Tiny(), mode_for(config, CPU), warm_shapes=2)
    assert seen["mode"] == "max-autotune", "on CPU the graphs are dropped, so inductor decides"


def test_mode_labels_and_default_tolerances() -> None:
    assert mode_for(tiny_config(precision="bf16"), CPU).mode == "bf16"
    assert mode_for(tiny_config(precision="bf16"), CPU).tolerance == 1e-2
    plan = mode_for(tiny_config(compile=True), CPU)
    assert plan.mode == "compile" and plan.tolerance == 1e-4
    both = tiny_config(precision="fp16", compile=True, compile_mode="max-autotune")
    assert mode_for(both, CPU).mode == "fp16+max-autotune"
    assert mode_for(tiny_config(precision="bf16", accuracy_tolerance=0.5), CPU).tolerance == 0.5
    layout = mode_for(tiny_config(channels_last=True, precision="bf16", compile=True), CPU)
    assert layout.mode == "bf16+channels_last+compile"
    assert mode_for(tiny_config(channels_last=True), CPU).tolerance == 1e-4


def test_cuda_graphs_on_cpu_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    config = tiny_config(cuda_graphs=True, compile_buckets=(1, 8))
    with caplog.at_level(logging.WARNING, "nograd.runtime.speed.guard"):
        plan = mode_for(config, CPU)
    assert not plan.cuda_graphs and not plan.requested
    assert "cuda_graphs = true is ignored on cpu" in caplog.text
    cuda = mode_for(config, torch.device("cuda", 0))
    assert cuda.cuda_graphs and cuda.mode == "cudagraphs" and cuda.buckets == Buckets((1, 8))


BASE = """
name = "m"
device = "cpu"
max_batch_size = 16
{extra}
[[inputs]]
name = "x"
datatype = "FP32"
shape = [4]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [2]
"""


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ("compile = true\ncompile_buckets = [8, 4]", "compile_buckets", "strictly ascending"),
        ("compile = true\ncompile_buckets = [0, 4]", "compile_buckets", "positive"),
        ("compile = true\ncompile_buckets = []", "compile_buckets", "at least one"),
        ("compile_buckets = [1, 4]", "compile_buckets", "compile = true"),
        ("compile = true\ncompile_buckets = [1, 32]", "compile_buckets", "max_batch_size 16"),
        ("compile = true\ncompile_length_buckets = [8]", "compile_length_buckets", "tokens"),
        ("cuda_graphs = true", "cuda_graphs", "needs compile_buckets"),
        (
            'cuda_graphs = true\ncompile = true\ncompile_mode = "reduce-overhead"\n'
            "compile_buckets = [1]",
            "cuda_graphs",
            "reduce-overhead",
        ),
        ('compile_mode = "max-autotune"', "compile_mode", "compile = true"),
        ("autocast = true", "autocast", "bf16 or fp16"),
        ('compile = true\ncompile_mode = "turbo"', "compile_mode", "turbo"),
        ("accuracy_tolerance = 0", "accuracy_tolerance", "greater than 0"),
        ("min_cosine = 1.5", "min_cosine", "less than or equal to 1"),
        ("min_speedup = -1", "min_speedup", "greater than or equal to 0"),
    ],
)
def test_config_errors_name_the_field(tmp_path: Path, extra: str, field: str, words: str) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.toml").write_text(BASE.format(extra=extra))
    with pytest.raises(ConfigError) as raised:
        load_config(folder / "config.toml")
    assert f"'{field}'" in str(raised.value) and words in str(raised.value), str(raised.value)


def test_token_model_with_fixed_shapes_needs_both_bucket_lists() -> None:
    with pytest.raises(ValueError, match="compile_length_buckets"):
        text_config(compile=True, compile_buckets=(1, 8))
    config = text_config(compile=True, compile_buckets=(1, 8), compile_length_buckets=(16, 64))
    assert mode_for(config, CPU).buckets == Buckets((1, 8), (16, 64))


# ------------------------------------------------------------------------------ CUDA graphs
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


# ------------------------------------------------------------------------------ data plane hook
MODEL_PY = """
import torch

class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x)

def build(model_dir):
    torch.manual_seed(0)
    return Scale()
"""


async def loaded_plane(tmp_path: Path, extra: str, metrics: Metrics) -> DataPlane:
    """A data plane serving model ``m`` (MODEL_PY) with ``extra`` config lines."""
    folder = tmp_path / "repo" / "m"
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(MODEL_PY)
    (folder / "config.toml").write_text(BASE.format(extra='weights = ""\n' + extra))
    plane = DataPlane(Settings(model_repository=tmp_path / "repo"), metrics)  # type: ignore[call-arg]
    plane.discover()
    await plane.load_all()
    return plane


async def test_data_plane_serves_the_fallback_when_the_guard_refuses(tmp_path: Path) -> None:
    metrics = Metrics()
    plane = await loaded_plane(tmp_path, 'precision = "bf16"\naccuracy_tolerance = 1e-7', metrics)
    try:
        assert plane.ready()
        handler = plane.models["m"].handler
        assert handler is not None and handler.speed_mode == "fp32"
        delta = gauge(metrics, "nograd_model_accuracy_delta", "m", "bf16")
        assert delta is not None and delta > 1e-7
        _, outputs = await plane.infer("m", None, {"x": np.ones((2, 4), dtype=np.float32)})
        assert outputs["y"].dtype == np.float32 and outputs["y"].shape == (2, 2)
    finally:
        await plane.stop()


async def test_data_plane_caps_batches_at_the_largest_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch above the largest bucket would run as several forwards with every caller waiting
    for all of them: the batcher forms batches of at most that bucket instead."""

    def compile_eager(model: torch.nn.Module, **options: Any) -> Any:
        return REAL_COMPILE(model, backend="eager", **options)

    monkeypatch.setattr(torch, "compile", compile_eager)
    metrics = Metrics()
    plane = await loaded_plane(tmp_path, "compile = true\ncompile_buckets = [1, 4]", metrics)
    try:
        model = plane.models["m"]
        assert model.handler is not None and model.handler.speed_mode == "compile"
        assert model.batcher is not None
        assert model.batcher.limit.current == 4 and model.batcher.limit.measured == 16
        x = np.arange(40, dtype=np.float32).reshape(10, 4)
        results = await asyncio.gather(
            *(plane.infer("m", None, {"x": x[i : i + 1]}) for i in range(10)),
            plane.infer("m", None, {"x": x}),
        )
        whole = results[-1][1]["y"]
        assert np.allclose(np.concatenate([r[1]["y"] for r in results[:-1]]), whole, atol=1e-6)
        sizes = metrics.registry.get_sample_value(
            "nograd_batch_size_bucket", {"model": "m", "le": "4.0"}
        )
        count = metrics.registry.get_sample_value("nograd_batch_size_count", {"model": "m"})
        assert sizes is not None and sizes == count, "every batch took at most 4 rows"
    finally:
        await plane.stop()


# ------------------------------------------------------------------------------ shipped models
ROOT = Path(__file__).resolve().parents[3]


def shipped(name: str, **levers: Any) -> ModelHandler:
    raw = load_config(ROOT / "models" / name / "config.toml").model_dump()
    raw.update(levers)
    config = ModelConfig.model_validate(raw)
    return build_handler(ROOT / "models", ROOT / "models" / name, config, CPU)


def test_minilm_bucket_padding_leaves_embeddings_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real BERT, real tokens: padded rows and masked padding tokens change nothing (compile is
    an identity here, so what is checked is the padding, under the fp32 tolerance). Few shapes:
    each new shape costs oneDNN a first-time kernel build on CPU."""
    monkeypatch.setattr(torch, "compile", lambda model, **options: model)
    handler = shipped("minilm", compile=True, compile_buckets=[2], compile_length_buckets=[32])
    assert sequence_inputs(handler) == frozenset({"input_ids", "attention_mask", "token_type_ids"})
    served = apply_speed(handler, limit=72)
    assert served.speed_mode == "compile", "padding moved embeddings beyond 1e-4"
    assert batch_cap(served) == 2 * 32
    texts = np.array([b"A man is eating food.", b"Short.", b"x " * 20], dtype=np.object_)
    out = TorchRunner(served).run_batch([served.prepare({"text": texts})])[0]
    assert out["embedding"].shape == (3, 384)
    assert out["token_count"][:, 0].tolist()[1] == 4


def test_minilm_bf16_autocast_keeps_packing_and_passes_its_check() -> None:
    """Autocast fixes no shapes, so minilm's forward still skips padding under it; the accuracy
    check (against fp32 eager, padded and packed alike) must accept the packed bf16 forward."""
    handler = shipped("minilm", precision="bf16", autocast=True)
    metrics = Metrics()
    served = apply_speed(handler, limit=256, report_check=recorder(metrics))
    assert served.speed_mode == "bf16-autocast"
    assert served.speed_path is not None and not served.speed_path.fixed_shapes
    delta = gauge(metrics, "nograd_model_accuracy_delta", "minilm", "bf16-autocast")
    assert delta is not None and delta < 2e-2
    calls: list[bool] = []
    module = served.module

    def spy(*tensors: torch.Tensor, packed: bool) -> torch.Tensor:
        calls.append(packed)
        return module(*tensors, packed=packed)

    texts = np.array([b"A man is eating food.", b"Short."], dtype=np.object_)
    served.module = spy  # type: ignore[assignment]
    try:
        out = TorchRunner(served).run_batch([served.prepare({"text": texts})])[0]
    finally:
        served.module = module
    assert calls == [True]
    assert out["embedding"].shape == (2, 384)


def test_shipped_digits_channels_last_converts_weights_and_inputs_and_passes_its_check() -> None:
    metrics = Metrics()
    reference = shipped("digits", channels_last=False)
    handler = shipped("digits")
    sample = load_accuracy_sample(handler, ROOT / "models" / "digits")
    served = apply_speed(handler, 64, sample, recorder(metrics))
    assert served.speed_mode == "channels_last"
    conv = served.module.features[2].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    part = served.example(rows=5)
    batch = served.collate([part])
    assert batch["image"].is_contiguous(memory_format=torch.channels_last)
    assert reference.collate([part])["image"].is_contiguous()
    out = TorchRunner(served).run_batch([part])[0]
    expected = TorchRunner(reference).run_batch([part])[0]
    np.testing.assert_allclose(out["logits"], expected["logits"], atol=1e-5)
    assert (out["label"] == expected["label"]).all()
    delta = gauge(metrics, "nograd_model_accuracy_delta", "digits", "channels_last")
    assert delta is not None and delta < 1e-4


class FlattensWithView(torch.nn.Module):
    """A convolution model written for contiguous feature maps: ``view`` cannot flatten NHWC."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(1, 2, kernel_size=3, padding=1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        features = self.conv(image)
        return features.view(features.shape[0], -1).sum(dim=1, keepdim=True)


def test_channels_last_on_a_model_that_views_feature_maps_falls_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = ModelConfig(
        name="viewer",
        weights=None,
        inputs=(TensorSpec(name="image", datatype="FP32", shape=(1, 4, 4)),),
        outputs=(TensorSpec(name="total", datatype="FP32", shape=(1,)),),
        channels_last=True,
    )
    handler = ModelHandler(FlattensWithView().eval(), config, CPU)
    with caplog.at_level(logging.WARNING, "nograd.runtime.speed.guard"):
        served = apply_speed(handler, limit=8)
    assert served.speed_mode == "fp32"
    assert "speed mode channels_last refused, serving fp32 eager: building it failed" in caplog.text
    assert served.memory_format is torch.contiguous_format
    assert served.module.conv.weight.is_contiguous()
    out = TorchRunner(served).run_batch([served.example(rows=3)])[0]
    assert out["total"].shape == (3, 1)


def test_digits_bf16_is_within_the_default_tolerance() -> None:
    metrics = Metrics()
    handler = shipped("digits", precision="bf16", channels_last=False)
    served = apply_speed(handler, limit=64, report_check=recorder(metrics))
    assert served.speed_mode == "bf16"
    delta = gauge(metrics, "nograd_model_accuracy_delta", "digits", "bf16")
    assert delta is not None and delta < 1e-2


def test_digits_bf16_is_refused_on_its_real_sample(caplog: pytest.LogCaptureFixture) -> None:
    """Synthetic pixels (0..1) pass bf16; the two real digits of sample.json (0..16) do not:
    logits of real inputs are larger, and so is their bf16 rounding."""
    metrics = Metrics()
    handler = shipped("digits", precision="bf16", channels_last=False)
    with caplog.at_level(logging.WARNING, "nograd.runtime.speed.guard"):
        sample = load_accuracy_sample(handler, ROOT / "models" / "digits")
        served = apply_speed(handler, 64, sample, recorder(metrics))
    assert served.speed_mode == "fp32"
    assert "output 'logits' max abs error" in caplog.text
    delta = gauge(metrics, "nograd_model_accuracy_delta", "digits", "bf16")
    assert delta is not None and delta > 1e-2


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{not json", "malformed JSON"),
        ('{"inputs": [{"name": "z", "shape": [1], "datatype": "FP32", "data": [1]}]}', "['z']"),
        (
            '{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}',
            "input 'x' is FP32 [1, 2]; the model takes FP32 [-1, 4]",
        ),
        (None, "No such file"),
    ],
)
def test_unreadable_accuracy_sample_fails_naming_the_field(
    tmp_path: Path, content: str | None, words: str
) -> None:
    if content is not None:
        (tmp_path / "sample.json").write_text(content)
    handler = ModelHandler(Tiny().eval(), tiny_config(precision="bf16"), CPU)
    handler.config = tiny_config(precision="bf16", accuracy_sample="sample.json")
    with pytest.raises(ValueError, match="field 'accuracy_sample'") as raised:
        load_accuracy_sample(handler, tmp_path)
    assert words in str(raised.value)


def test_accuracy_sample_must_stay_inside_the_model_folder() -> None:
    with pytest.raises(ValueError, match="inside the model folder"):
        tiny_config(accuracy_sample="../other/sample.json")


@pytest.mark.slow
def test_real_inductor_compile_serves_or_falls_back_cleanly() -> None:
    """Real torch.compile (inductor, C++ codegen): about 15-30 s on 2 cores."""
    handler = tiny(compile=True, compile_buckets=(1, 8))
    served = apply_speed(handler, limit=8, report_check=recorder(Metrics()))
    assert served.speed_mode in ("compile", "fp32")
    out = TorchRunner(served).run_batch([rows_of(*range(11))])[0]
    assert out["y"].shape == (11, 3)
