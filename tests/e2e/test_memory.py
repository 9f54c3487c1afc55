"""Memory-sized batches and out-of-memory recovery, through the real server."""

from __future__ import annotations

import asyncio
import math
import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from tests.e2e.serving import ROOT, run_server

pytestmark = pytest.mark.e2e
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"


def repository(tmp_path: Path, *sources: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    for source in sources:
        shutil.copytree(source, repo / source.name)
    return repo


def scrape(url: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    found: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.name, sample.labels, sample.value))
    return found


def value(
    found: dict[str, list[tuple[str, dict[str, str], float]]], name: str, **labels: str
) -> float:
    for _, sample_labels, sample_value in found[name]:
        if all(sample_labels.get(k) == v for k, v in labels.items()):
            return sample_value
    raise AssertionError(f"{name}{labels} not exported")


def batch_size_buckets(
    found: dict[str, list[tuple[str, dict[str, str], float]]], model: str
) -> dict[float, float]:
    return {
        float(labels["le"]): v
        for _, labels, v in found["nograd_batch_size_bucket"]
        if labels["model"] == model
    }


def planned_cost(log: str, model: str) -> tuple[float, float]:
    """(fixed bytes, bytes per sample) of the cost model the plan logged for ``model``."""
    found = re.search(rf"model {model} on \S+: cost model (\d+) B \+ ([\d.]+) B/unit", log)
    assert found is not None, "the plan logged no cost model"
    return float(found[1]), float(found[2])


def reference_digits(images: np.ndarray) -> np.ndarray:
    import importlib.util

    spec = importlib.util.spec_from_file_location("digits_ref", ROOT / "models/digits/model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.build(ROOT / "models/digits")
    model.load_state_dict(load_file(ROOT / "models/digits/model.safetensors"))
    model.eval()
    with torch.inference_mode():
        return model(torch.from_numpy(images))["logits"].numpy()


async def post_all(url: str, path: str, bodies: list[dict[str, object]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await asyncio.gather(*(client.post(path, json=body) for body in bodies))


def test_small_budget_shrinks_the_limit_and_no_batch_exceeds_it(tmp_path: Path) -> None:
    # digits on eager: the plan's cost model (logged) gives the largest batch whose predicted
    # peak fits 1 MiB: a few dozen samples, where 64 run without a budget.
    repo = repository(tmp_path, ROOT / "models/digits")
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_MEMORY_BUDGET_BYTES": "1048576",
        "NOGRAD_LOG_LEVEL": "debug",  # the plan's cost model, logged at debug level
    }
    with run_server(tmp_path, env) as server:
        found = scrape(server.url)
        assert value(found, "nograd_device_memory_budget_bytes", device="cpu") == 1048576
        sample_bytes = value(found, "nograd_model_sample_bytes", model="digits")
        assert 12_000 < sample_bytes < 40_000
        limit = int(value(found, "nograd_batch_limit", model="digits"))
        fixed, per_sample = planned_cost(server.log(), "digits")
        assert per_sample == pytest.approx(sample_bytes, rel=0.01)
        assert abs(limit - (1048576 - fixed) // per_sample) <= 1  # the log rounds the bytes
        assert 1 < limit < 64
        assert "memory plan for cpu" in server.log()
        bucket = float(2 ** math.ceil(math.log2(limit)))

        rng = np.random.default_rng(3)
        images = rng.integers(0, 17, size=(64, 1, 8, 8)).astype(np.float32)
        bodies: list[dict[str, object]] = [
            {
                "inputs": [
                    {
                        "name": "image",
                        "shape": [1, 1, 8, 8],
                        "datatype": "FP32",
                        "data": images[i].reshape(-1).tolist(),
                    }
                ]
            }
            for i in range(64)
        ]
        # One request larger than the limit too: it is split across forwards.
        bodies.append(
            {
                "inputs": [
                    {
                        "name": "image",
                        "shape": [10, 1, 8, 8],
                        "datatype": "FP32",
                        "data": images[:10].reshape(-1).tolist(),
                    }
                ]
            }
        )
        before = batch_size_buckets(scrape(server.url), "digits")
        responses = asyncio.run(post_all(server.url, "/v2/models/digits/infer", bodies))
        expected = reference_digits(images)
        for i, response in enumerate(responses[:64]):
            assert response.status_code == 200, response.text
            logits = np.asarray(response.json()["outputs"][0]["data"]).reshape(1, 10)
            assert np.allclose(logits[0], expected[i], atol=1e-4)
        big = responses[64].json()["outputs"][0]
        assert big["shape"] == [10, 10]
        assert np.allclose(np.asarray(big["data"]).reshape(10, 10), expected[:10], atol=1e-4)

        after_found = scrape(server.url)
        after = batch_size_buckets(after_found, "digits")
        ran = after[float("inf")] - before[float("inf")]
        within_limit = after[bucket] - before[bucket]
        assert ran > 0 and within_limit == ran, "a batch above the memory-derived limit ran"
        assert value(after_found, "nograd_batch_predicted_bytes_count", model="digits") > 0


def test_out_of_memory_splits_batches_and_loses_no_request(tmp_path: Path) -> None:
    repo = repository(tmp_path, FIXTURES / "oomy")
    with run_server(tmp_path, {"NOGRAD_MODEL_REPOSITORY": str(repo)}) as server:
        bodies: list[dict[str, object]] = [
            {
                "inputs": [
                    {
                        "name": "x",
                        "shape": [1, 4],
                        "datatype": "FP32",
                        "data": [float(i), 1.0, 2.0, 3.0],
                    }
                ]
            }
            for i in range(64)
        ]
        too_large = {
            "inputs": [
                {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [999.0, 0.0, 0.0, 0.0]}
            ]
        }
        responses = asyncio.run(
            post_all(server.url, "/v2/models/oomy/infer", [*bodies[:32], too_large, *bodies[32:]])
        )
        rejected = responses.pop(32)
        assert rejected.status_code == 507
        assert "does not fit" in rejected.json()["error"]
        for i, response in enumerate(responses):
            assert response.status_code == 200, response.text
            assert response.json()["outputs"][0]["data"] == [2.0 * i, 2.0, 4.0, 6.0]

        # A second wave finds the lowered limit and runs without any new OOM above it.
        asyncio.run(post_all(server.url, "/v2/models/oomy/infer", bodies))
        found = scrape(server.url)
        assert value(found, "nograd_batch_limit", model="oomy") <= 5
        assert value(found, "nograd_oom_total", model="oomy") >= 1
        assert value(found, "nograd_batch_splits_total", model="oomy") >= 1
        assert value(found, "nograd_requests_total", model="oomy", code="507") == 1
