"""What a config asks of its speed mode: buckets, padding, labels, tolerances, config errors."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nograd.runtime.handler import TorchRunner, _pad_concat, chunk_rows
from nograd.runtime.speed.guard import (
    check_batches,
    sequence_inputs,
)
from nograd.runtime.speed.mode import Buckets, mode_for, next_bucket
from nograd.runtime.speed.path import SpeedModePath, batch_cap
from nograd.schema.config import ConfigError, load_config
from tests.unit.runtime.speed.conftest import (
    BASE,
    CPU,
    RecordingTiny,
    Tiny,
    TinyText,
    recording,
    rows_of,
    text,
    text_config,
    tiny,
    tiny_config,
)


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
