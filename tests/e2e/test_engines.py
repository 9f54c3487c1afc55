"""Engines in the real server: the shipped models on engine = "auto" (built, checked, timed, the
table logged and exported, the cache reused by the next start), and exported model folders
served over HTTP with the eager model's answers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from nograd.runtime.handler import TorchRunner
from nograd.runtime.loader import build_handler
from nograd.schema.config import load_config
from tests.e2e.serving import ROOT, Server, metric_value, run_server
from tests.e2e.test_server import metrics, output
from tests.shipped_exports import publish_built_engines, shipped_export

pytestmark = pytest.mark.e2e

SAMPLE = json.loads((ROOT / "models/digits/sample.json").read_text())
TEXTS = ["A man is eating food.", "The engine is picked by measurement.", "ok"]


@pytest.fixture(scope="module")
def eager_embeddings() -> np.ndarray:
    folder = ROOT / "models/minilm"
    handler = build_handler(
        ROOT / "models", folder, load_config(folder / "config.toml"), torch.device("cpu")
    )
    part = handler.prepare({"text": np.array([t.encode() for t in TEXTS], dtype=object)})
    return TorchRunner(handler).run_batch([part])[0]["embedding"]


def embed(url: str, model: str) -> np.ndarray:
    body = {"inputs": [{"name": "text", "shape": [len(TEXTS)], "datatype": "BYTES", "data": TEXTS}]}
    response = httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return output(response.json(), "embedding")


def digits_labels(url: str, model: str) -> list[int]:
    response = httpx.post(f"{url}/v2/models/{model}/infer", json=SAMPLE, timeout=30)
    assert response.status_code == 200, response.text
    return [int(v) for v in output(response.json(), "label").reshape(-1)]


def test_shipped_models_on_auto_then_a_restart_reuses_the_built_engines(
    tmp_path: Path, eager_embeddings: np.ndarray
) -> None:
    env = {"NOGRAD_ENGINE": "", "NOGRAD_ENGINE_CACHE": str(tmp_path / "cache")}
    with run_server(tmp_path, env=env, ready_timeout_s=240) as server:
        log = server.log()
        for model in ("digits", "minilm"):
            assert f"model {model}: built the onnx engine" in log
            assert f"model {model}: engines measured at load" in log
        assert_a_start_up_log_a_person_reads(server, {"digits", "minilm"})
        speedups = {
            (labels["model"], labels["mode"])
            for labels, _, _ in metrics(server)["nograd_model_speedup"]
        }
        assert {("digits", "onnx"), ("minilm", "onnx")} <= speedups
        eager_server_labels = digits_labels(server.url, "digits")
        np.testing.assert_allclose(embed(server.url, "minilm"), eager_embeddings, atol=1e-5)
    assert len(list((tmp_path / "cache").glob("*.onnx"))) == 2
    publish_built_engines(tmp_path / "cache")
    with run_server(tmp_path, env=env, ready_timeout_s=240) as again:
        log = again.log()
        # Same files and versions: the choice itself comes from the cache, nothing is exported,
        # built, checked or timed again, and the metrics still say what serves.
        assert "built the onnx engine" not in log
        assert "engines measured at load" not in log
        for model in ("digits", "minilm"):
            assert f"model {model}: engines as chosen at an earlier load" in log
            # The memory plan's profile too: planned from the record, not measured again.
            assert f"model {model}: memory profile as measured at an earlier load" in log
        again_speedups = {
            (labels["model"], labels["mode"])
            for labels, _, _ in metrics(again)["nograd_model_speedup"]
        }
        assert {("digits", "onnx"), ("minilm", "onnx")} <= again_speedups
        assert digits_labels(again.url, "digits") == eager_server_labels
        np.testing.assert_allclose(embed(again.url, "minilm"), eager_embeddings, atol=1e-5)


def assert_a_start_up_log_a_person_reads(server: Server, models: set[str]) -> None:
    """A fresh start (the engines exported, built, checked and timed) logs nograd's own account
    only: every line a JSON record, no library's INFO line (ONNX export passes, ...) or stray
    warning, and at ready one summary naming each model with its engine, limit and memory."""
    log = server.log()
    lines = [line for line in log.splitlines() if line.strip()]
    records = server.records()
    assert len(records) == len(lines), [line for line in lines if not line.startswith("{")]
    # nograd's loggers (its models' code included: ``nograd_models.*``) and uvicorn's own lines.
    own = {"nograd", "nograd_models", "uvicorn"}
    strays = [r for r in records if r["level"] == "info" and r["logger"].split(".")[0] not in own]
    assert strays == [], strays
    assert [r for r in records if r["logger"] == "py.warnings"] == []
    summary = server.ready_summary()
    assert set(summary) == models
    for row in summary.values():
        assert row["level"] == "info" and row["message"].startswith("ready: serving")
        assert (row["state"], row["format"], row["device"]) == ("ready", "python", "cpu")
        measured = f"model {row['model']}: engines measured at load"
        chosen = {r["message"] for r in records if r["message"].startswith(measured)}
        assert {message.rsplit("; serving ", 1)[1] for message in chosen} == {row["engine"]}
        assert row["limit"] == metric_value(server.url, "nograd_batch_limit", model=row["model"])
        assert row["weights_bytes"] > 0 and row["batch_bytes"] > 0
        assert row["engines_s"] > 0 and row["profile_s"] > 0
        assert row["since_start_s"] >= row["load_s"] >= row["engines_s"]
    # Its details at debug level: the memory plan and each fit are in the summary's rows.
    assert "memory plan for cpu" not in log


def test_exported_folders_serve_the_eager_models_answers(
    tmp_path: Path, eager_embeddings: np.ndarray, server: Server
) -> None:
    """``server``: the suite's shared server, the shipped models on eager, is the reference.
    The folders are the run's exports (``tests/shipped_exports.py``), which the export tests
    check against eager too."""
    repository = tmp_path / "repository"
    shutil.copytree(shipped_export("digits", "onnx"), repository / "digits-onnx")
    shutil.copytree(shipped_export("minilm", "torch_export"), repository / "minilm-export")
    with run_server(tmp_path, env={"NOGRAD_MODEL_REPOSITORY": str(repository)}) as exported:
        expected = digits_labels(server.url, "digits")
        assert digits_labels(exported.url, "digits-onnx") == expected
        np.testing.assert_allclose(
            embed(exported.url, "minilm-export"), eager_embeddings, atol=1e-5
        )
        metadata = httpx.get(f"{exported.url}/v2/models/digits-onnx").json()
        assert [i["name"] for i in metadata["inputs"]] == ["image"]
        assert "model digits-onnx v1 loaded" in exported.log()
