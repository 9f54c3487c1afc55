"""The residency section renders what the phase recorded (no server); a run removes the models
it generated."""

from __future__ import annotations

from pathlib import Path

from bench.report.residency import residency_section
from bench.residency_models import onnx_repository, remove_generated


def test_the_section_shows_cold_resident_and_both_working_sets() -> None:
    record = {
        "models": 8,
        "weights_mib": 8,
        "limit_mib": 64,
        "clients": 4,
        "seconds": 6.0,
        "cold_ms": [200.0, 300.0, 250.0],
        "resident_ms": [2.0, 3.0, 2.5],
        "wrong": 0,
        "fits": {"models": 3, "rps": 500.0, "p50_ms": 7.0, "p99_ms": 20.0, "loads": 0, "wrong": 0},
        "exceeds": {
            "models": 8,
            "rps": 20.0,
            "p50_ms": 150.0,
            "p99_ms": 900.0,
            "loads": 40,
            "wrong": 0,
        },
    }
    text = "\n".join(residency_section({"residency": record}, "2 cores"))
    assert "NOGRAD_MEMORY_LIMIT_BYTES=64MiB" in text
    assert "| cold (loads the model) | 250 | 300 | 300 |" in text
    assert "| resident | 2.5 | 3.0 | 3.0 |" in text
    assert "| 3 models (fits the limit) | 500 | 7.0 | 20.0 | 0 | 0 |" in text
    assert "| 8 models (exceeds the limit) | 20.0 | 150 | 900 | 40 | 0 |" in text
    assert residency_section({}, "2 cores") == []


def test_the_section_shows_the_zipf_run_and_minilm_cold() -> None:
    record = {
        **dict.fromkeys(("models", "weights_mib"), 8),
        "limit_mib": 64,
        "clients": 4,
        "seconds": 6.0,
        "cold_ms": [200.0],
        "resident_ms": [2.0],
        "zipf": {
            "models": 24,
            "answered_models": 24,
            "weights_mib": 32,
            "limit_mib": 256,
            "clients": 8,
            "seconds": 60.0,
            "rps": 12.5,
            "p50_ms": 40.0,
            "p99_ms": 2000.0,
            "loads": 300,
            "evictions": 290,
            "wrong": 0,
        },
        "minilm": {"cold_ms": 1500.0, "cold_status": 200, "resident_ms": 9.0},
    }
    text = "\n".join(residency_section({"residency": record}, "2 cores"))
    assert "NOGRAD_MEMORY_LIMIT_BYTES=256MiB`, 8 clients asking with Zipf popularity" in text
    assert "| 12.5 | 40.0 | 2,000 | 24 of 24 | 300 | 290 | 0 |" in text
    assert "| first request (loads it) | 1,500 | 200 |" in text
    assert "| first after an unload | – | – |" in text


def test_a_run_removes_its_generated_models_and_their_engine_cache(tmp_path: Path) -> None:
    """The generated repositories and their mapped forms (1.6 GB a full run) go at a phase's
    end; the replicas' logs under ``state`` stay."""
    onnx_repository(tmp_path, models=2, weights_mib=1)
    (tmp_path / "engines" / "mapped").mkdir(parents=True)
    (tmp_path / "engines" / "mapped" / "m0.weights").write_bytes(b"0" * 16)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "haproxy.log").write_text("kept")
    remove_generated(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["state"]
    assert (tmp_path / "state" / "haproxy.log").read_text() == "kept"


def test_a_run_that_left_nothing_else_leaves_no_folder(tmp_path: Path) -> None:
    folder = tmp_path / "run-residency"
    onnx_repository(folder, models=1, weights_mib=1)
    remove_generated(folder)
    assert not folder.exists()
