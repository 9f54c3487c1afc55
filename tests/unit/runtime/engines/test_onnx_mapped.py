"""ONNX weights memory-mapped from a mapped form (``nograd.runtime.engines.onnx_mapped``): the
session answers as the file does, its opening rises by the weights once (ONNX Runtime copied a
file's embedded weights out of the protobuf it parsed them into: twice), and what it holds is the
weights, in the process's resident memory where the on-demand accounting measures it."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.residency_models import MIB, ROWS, write_onnx_model
from nograd.host.heap import release_free_memory
from nograd.host.peak import ResidentPeak
from nograd.runtime.engines import onnx as onnx_engine
from nograd.runtime.engines import onnx_mapped
from nograd.runtime.engines.onnx_mapped import WEIGHTS_SUFFIX, mapped_form

pytest.importorskip("onnxruntime")

CPU = torch.device("cpu")
WEIGHTS_MIB = 32
RISE_BOUND = 1.3
"""Times its file's size an opening may rise by (its weights once, with room for the graph)."""


@pytest.fixture
def mapped(tmp_path: Path) -> Iterator[Path]:
    """Weights mapped from a cache folder of this test's for the test's duration."""
    cache = tmp_path / "cache"
    onnx_mapped.map_weights(cache)
    try:
        yield cache
    finally:
        onnx_mapped.map_weights(None)


def model_file(root: Path, index: int, weights_mib: int) -> Path:
    write_onnx_model(root / f"m{index}", index, weights_mib)
    return root / f"m{index}" / "1" / "model.onnx"


def answers(path: Path, rows: np.ndarray) -> np.ndarray:
    opened = onnx_engine.OnnxPath("onnx", path, CPU)
    return np.asarray(opened.run_arrays({"X": rows})["Y"])


def test_a_mapped_session_rises_by_its_weights_once_and_holds_them(
    tmp_path: Path, mapped: Path
) -> None:
    path = model_file(tmp_path, 3, WEIGHTS_MIB)
    size = path.stat().st_size
    onnx_engine.warm_onnx_runtime()
    # What earlier tests in this process freed goes back first: a session's load hands the
    # heap's free memory back too, which would read as memory the model gave.
    gc.collect()
    release_free_memory()
    peak = ResidentPeak()
    before = peak.resident_bytes()
    opened, rise = peak.measure(lambda: onnx_engine.OnnxPath("onnx", path, CPU))
    held = peak.resident_bytes() - before
    # The first opening writes the mapped form too: file to file, nothing of it held here.
    assert rise.extra_bytes <= RISE_BOUND * size, (rise, size)
    # Its seating run read every weight: the mapped pages are in the resident set, which is
    # what a load on demand counts its model by.
    assert 0.8 * size <= held <= RISE_BOUND * size, (held / MIB, size / MIB)
    rows = np.zeros((4, ROWS), dtype=np.float32)
    assert opened.run_arrays({"X": rows})["Y"].ravel().tolist() == [3.0] * 4
    assert list(mapped.glob(f"*{WEIGHTS_SUFFIX}")), list(mapped.iterdir())
    del opened
    # Opened again (a reload, a profile's fresh session), it reads the same mapped form.
    again, rise_again = peak.measure(lambda: onnx_engine.OnnxPath("onnx", path, CPU))
    assert rise_again.extra_bytes <= RISE_BOUND * size, (rise_again, size)
    assert len(list(mapped.glob(f"*{WEIGHTS_SUFFIX}"))) == 1
    del again


def test_a_mapped_session_answers_as_the_file_does(tmp_path: Path) -> None:
    path = model_file(tmp_path, 5, 1)
    rows = np.random.default_rng(0).standard_normal((3, ROWS), dtype=np.float32)
    plain = answers(path, rows)
    onnx_mapped.map_weights(tmp_path / "cache")
    try:
        from_mapped = answers(path, rows)
    finally:
        onnx_mapped.map_weights(None)
    assert list((tmp_path / "cache").glob(f"*{WEIGHTS_SUFFIX}"))
    np.testing.assert_allclose(from_mapped, plain, rtol=1e-5)


def test_a_file_gets_a_mapped_form_of_its_own_and_the_forms_of_files_gone_or_edited_go(
    tmp_path: Path, mapped: Path
) -> None:
    path = model_file(tmp_path, 1, 1)
    rows = np.zeros((1, ROWS), dtype=np.float32)
    assert answers(path, rows).ravel().tolist() == [1.0]
    replacement = model_file(tmp_path / "other", 2, 1)
    os.replace(replacement, path)
    assert answers(path, rows).ravel().tolist() == [2.0]
    # The earlier content's form is gone: one per model file, however often it is replaced.
    assert len(list(mapped.glob(f"*{WEIGHTS_SUFFIX}"))) == 1
    other = model_file(tmp_path, 4, 1)
    assert answers(other, rows).ravel().tolist() == [4.0]
    assert len(list(mapped.glob(f"*{WEIGHTS_SUFFIX}"))) == 2
    # A model file removed: its form goes when the next one is written.
    path.unlink()
    third = model_file(tmp_path, 7, 1)
    assert answers(third, rows).ravel().tolist() == [7.0]
    assert len(list(mapped.glob(f"*{WEIGHTS_SUFFIX}"))) == 2
    assert onnx_mapped.mapped_files(other) and onnx_mapped.mapped_files(third)


def test_a_file_with_no_large_weight_or_no_protobuf_opens_as_it_is(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    small = tmp_path / "small.onnx"
    small.write_bytes(b"\x08\x08")  # ir_version 8, no graph: nothing to move
    assert mapped_form(small, cache) is None
    assert mapped_form(small, cache) is None  # remembered: not walked again
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\xff" * 64)
    assert mapped_form(garbage, cache) is None
    assert not list(cache.glob(f"*{WEIGHTS_SUFFIX}"))


def test_an_evicted_models_next_load_reads_its_mapped_form_and_its_signature_too(
    tmp_path: Path, mapped: Path
) -> None:
    """What an eviction keeps in the page cache for the model's next load (``mapped_files``)
    is the mapped form once written; reading the file's inputs and outputs (a config that
    leaves them out) opens that form as well, rising by no copy of the weights."""
    path = model_file(tmp_path, 2, WEIGHTS_MIB)
    size = path.stat().st_size
    assert onnx_mapped.mapped_files(path) == []
    onnx_engine.warm_onnx_runtime()
    (inputs, outputs), rise = ResidentPeak().measure(lambda: onnx_engine.onnx_tensors(path))
    assert [name for name, _, _ in inputs] == ["X"] and [n for n, _, _ in outputs] == ["Y"]
    assert rise.extra_bytes <= 0.3 * size, (rise, size)
    graph, weights = onnx_mapped.mapped_files(path)
    assert graph.parent == weights.parent == mapped
    assert weights.stat().st_size >= WEIGHTS_MIB * MIB > graph.stat().st_size
    onnx_mapped.map_weights(None)
    assert onnx_mapped.mapped_files(path) == []


def test_a_file_whose_weights_are_external_already_opens_as_it_is(
    tmp_path: Path, mapped: Path
) -> None:
    """ONNX Runtime maps external data itself: such a graph is left where its weights are,
    even with another large weight still embedded (moved alone, the graph would no longer
    find the others)."""
    import onnx
    from onnx import numpy_helper

    path = model_file(tmp_path, 6, 1)
    onnx.save_model(onnx.load(str(path)), str(path), save_as_external_data=True)
    model = onnx.load(str(path), load_external_data=False)
    unused = np.ones(1 << 16, dtype=np.float32)
    model.graph.initializer.append(numpy_helper.from_array(unused, "unused"))
    onnx.save_model(model, str(path))
    assert mapped_form(path, mapped) is None
    rows = np.zeros((1, ROWS), dtype=np.float32)
    assert answers(path, rows).ravel().tolist() == [6.0]
    assert not list(mapped.glob(f"*{WEIGHTS_SUFFIX}"))
