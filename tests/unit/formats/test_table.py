"""The format table: every row names a format, each entry and config finds its own, and a new
format is one sub-package and one row."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from nograd.formats import table
from nograd.formats.table import Format, every_format, format_of, reading_format, serving_format
from nograd.formats.triton.reading.config import read_triton
from nograd.observability.metrics import Metrics
from nograd.schema.config import ModelConfig, load_config
from nograd.serving.dataplane import DataPlane
from nograd.settings import Settings
from tests.unit.formats.scaled import format as scaled

ROOT = Path(__file__).resolve().parents[3]
TRITON = ROOT / "tests" / "fixtures" / "triton"


def test_every_row_names_a_format() -> None:
    assert [fmt.name for fmt in every_format()] == ["torchserve", "triton", "nograd"]
    assert all(isinstance(fmt, Format) for fmt in every_format())


def test_each_entry_of_the_repository_finds_its_format() -> None:
    assert format_of(ROOT / "models" / "digits") is not None
    assert format_of(ROOT / "models" / "digits").name == "nograd"  # type: ignore[union-attr]
    assert format_of(TRITON / "add_sub").name == "triton"  # type: ignore[union-attr]
    assert format_of(ROOT / "docs") is None


def test_a_config_is_served_by_the_format_that_read_it() -> None:
    archive = ModelConfig(name="m", inputs=(), outputs=(), format="torchserve", weights=None)
    assert serving_format(archive).name == "torchserve"
    assert serving_format(read_triton(TRITON / "add_sub")).name == "triton"  # the Python backend
    # Triton's ONNX backend is read into an engine's artifact, which nograd's runner opens.
    assert serving_format(read_triton(TRITON / "densenet_onnx")).name == "nograd"
    own = load_config(ROOT / "models" / "digits" / "config.toml")
    assert serving_format(own).name == "nograd"


def test_a_config_is_read_by_the_format_whose_entry_it_came_from() -> None:
    # Triton's ONNX model is served by nograd's runner, yet its refusals, warm-up and label are
    # Triton's: the format that read it answers them.
    onnx = read_triton(TRITON / "densenet_onnx")
    assert reading_format(onnx).name == "triton"
    assert reading_format(onnx).refuses_rows_over_batch_limit
    assert reading_format(onnx).shape_refusal_note.startswith("NOTE: Setting a non-zero")
    assert reading_format(onnx).label(onnx) == "triton/onnx"
    archive = ModelConfig(name="m", inputs=(), outputs=(), format="torchserve", weights=None)
    assert reading_format(archive).name == "torchserve"
    own = load_config(ROOT / "models" / "digits" / "config.toml")
    assert reading_format(own).name == "nograd"
    assert not reading_format(own).refuses_rows_over_batch_limit
    assert reading_format(own).warmup is None
    assert reading_format(own).label(own) == "python"


@pytest.fixture
def one_more_format(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The table with the ``scaled`` format of ``tests/unit/formats/scaled/`` first."""
    monkeypatch.setattr(table, "FORMATS", (scaled.ROW, *table.FORMATS))
    every_format.cache_clear()
    yield scaled.SCALED.name
    every_format.cache_clear()


async def test_a_new_format_is_one_sub_package_and_one_row(
    one_more_format: str, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    (repo / "tripled" / "1").mkdir(parents=True)
    (repo / "tripled" / scaled.FACTOR_FILE).write_text("3\n")
    assert format_of(repo / "tripled").name == one_more_format  # type: ignore[union-attr]
    plane = DataPlane(Settings(model_repository=repo), Metrics())  # type: ignore[call-arg]
    plane.discover()
    await plane.load_all()
    try:
        _, outputs = await plane.infer(
            "tripled", None, {"x": np.array([[1.0, 2.0]], dtype=np.float32)}
        )
        assert outputs["y"].tolist() == [[3.0, 6.0]]
    finally:
        await plane.stop()
