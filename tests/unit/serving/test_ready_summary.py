"""The start-up summary in process: one row per model version with what serves it, its limit,
memory and step times; a failed model says so; the first worker's summary is the one at INFO."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from nograd.serving.control.ready_summary import log_ready
from tests.unit.conftest import plane_for


async def test_the_summary_names_each_model_with_its_engine_limit_and_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An engine cache of its own: the run's shared one may hold poison's profile from an earlier
    # test, and this load is to measure it (``profile_s`` below).
    plane = plane_for(tmp_path, "poison", "slow", engine_cache=tmp_path / "engines")
    broken = tmp_path / "repo" / "broken"
    shutil.copytree(tmp_path / "repo" / "poison", broken)
    (broken / "config.toml").write_text(
        (broken / "config.toml").read_text().replace('name = "poison"', 'name = "broken"')
    )
    (broken / "model.py").write_text("raise ImportError('broken on purpose')")
    plane.discover()
    await plane.load_all()
    try:
        with caplog.at_level(logging.DEBUG, logger="nograd.serving.control.ready_summary"):
            log_ready(plane.registry, scan_s=0.25, load_s=1.5)
            log_ready(plane.registry, scan_s=0.25, load_s=1.5, worker=0)
            log_ready(plane.registry, scan_s=0.25, load_s=1.5, worker=1)
        single, first, second = [r for r in caplog.records if r.name.endswith("ready_summary")]
        assert single.getMessage() == "ready: serving 2 of 3 model versions"
        assert (single.levelno, first.levelno, second.levelno) == (
            logging.INFO,
            logging.INFO,
            logging.DEBUG,
        )
        assert not hasattr(single, "worker") and (first.worker, second.worker) == (0, 1)
        assert (single.scan_s, single.load_s) == (0.25, 1.5) and single.since_start_s > 0
        rows = {row["model"]: row for row in single.table}
        poison = rows["poison"]
        assert (poison["state"], poison["format"], poison["engine"]) == ("ready", "python", "eager")
        assert (poison["device"], poison["unit"]) == ("cpu", "samples")
        assert poison["limit"] == plane.models["poison"].batcher.limit.current
        assert 1 <= poison["limit"] <= 64
        assert poison["batch_bytes"] > 0 and poison["weights_bytes"] == 0  # no weights file
        assert poison["build_s"] > 0 and poison["profile_s"] > 0
        assert rows["slow"]["state"] == "ready"
        assert rows["broken"] == {
            **dict.fromkeys(rows["broken"], None),
            "model": "broken",
            "version": "1",
            "state": "failed",
            "format": "python",
            "build_s": rows["broken"]["build_s"],
        }
    finally:
        await plane.stop()
