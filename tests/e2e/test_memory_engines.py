"""Memory-sized batches on every engine, through the real server: a small budget shrinks each
model's batch limit whatever engine serves it, no batch runs above the limit, every request is
answered, and the server's resident memory while it runs batches at the limit rises no more than
the budget (plus the margin below) above where it idled.

The peak is read from outside, as the kernel keeps it: the server's resident high-water mark
(``VmHWM``), reset through ``/proc/<pid>/clear_refs`` right before the load.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import numpy as np
import pytest

from nograd.host.peak import ResidentPeak
from nograd.runtime.memory.fits import FIT_TOLERANCE
from tests.e2e.serving import ROOT, Server, metric_value, run_server
from tests.shipped_exports import publish_built_engines, seed_built_engines

pytestmark = pytest.mark.e2e

SMALL_BUDGET = 4 * 1024 * 1024
"""Holds a hundred or more digits samples on any engine, and not one 256-token minilm
sequence."""
MINILM_BUDGET = 48 * 1024 * 1024
"""Holds two to five 256-token minilm sequences, depending on the engine."""
FIT_MARGIN = FIT_TOLERANCE
"""The plan takes a fit whose check is off by up to this fraction of what was measured: a batch
at the limit may use that much more than its share."""
DIGITS_MARGIN = 2 * 1024 * 1024
"""What serving digits' load adds besides its batches: the requests' bodies, decoded arrays and
answers on a few connections, the interpreter's objects for them, and the kernels oneDNN builds
and keeps for each new batch size (BENCHMARKS.md, "Memory measured per engine")."""
MINILM_MARGIN = 8 * 1024 * 1024
"""The same for minilm, with its tokenising, and eager torch's run-to-run spread at 256 tokens
a text."""
CONNECTIONS = 4
"""Few callers, each sending batches' worth of rows: a batch at the limit without the memory
of many open connections, which grows with the callers and not with the batch."""
DIGITS_CAP = 1024
"""digits' max_batch_size in the test's repository: above what the budget holds on any engine,
so memory sets its limit, and batches large enough that the batches' memory, not serving's,
is what the peak shows."""
MINILM_CAP = 8192
LONG_TEXT = "memory " * 400
"""Tokenised past minilm's 256-token truncation: every text costs the longest sequence."""


@pytest.fixture(scope="module")
def engine_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One engine cache for the module's servers: each ONNX model is built once, or not at all
    where another test of the run built it; the choices and memory profiles are the module's
    own, measured by its first server."""
    cache = tmp_path_factory.mktemp("engines")
    seed_built_engines(cache)
    yield cache
    publish_built_engines(cache)


def repository(root: Path, engine: str, *names: str) -> Path:
    """The shipped models; with an engine forced, served whatever its speed against eager (the
    choice would otherwise keep eager on a busy machine, and the engine would go unmeasured)."""
    repo = root / "repo"
    for name in names:
        shutil.copytree(ROOT / "models" / name, repo / name)
        config = repo / name / "config.toml"
        text = config.read_text()
        if name == "digits":
            text = text.replace("max_batch_size = 64", f"max_batch_size = {DIGITS_CAP}")
        if engine != "auto":
            # Top-level keys come before the first table ([[inputs]]).
            text = "min_speedup = 0\n" + text
        config.write_text(text)
    return repo


Serve = Callable[..., AbstractContextManager[Server]]
"""Starts a server: engine, budget, the shipped models to serve."""


@pytest.fixture
def serve(engine_cache: Path, tmp_path: Path) -> Serve:
    def start(engine: str, budget: int, *names: str) -> AbstractContextManager[Server]:
        env = {
            "NOGRAD_MODEL_REPOSITORY": str(repository(tmp_path, engine, *names)),
            "NOGRAD_ENGINE": engine,
            "NOGRAD_ENGINE_CACHE": str(engine_cache),
            "NOGRAD_MEMORY_BUDGET_BYTES": str(budget),
            # The load is about memory: a busy machine's slow batch must not shed requests.
            "NOGRAD_MAX_QUEUE_WAIT_S": "120",
            # The plan and each fit's numbers: at debug level (the start-up summary has the rest).
            "NOGRAD_LOG_LEVEL": "debug",
        }
        return run_server(tmp_path, env, ready_timeout_s=600)

    return start


Call = tuple[bytes, dict[str, str]]
"""A request's body and headers."""


def digits_call(rows: int, seed: int) -> Call:
    """``rows`` images as binary tensor data (the V2 binary extension), the label asked back the
    same way: the request's memory is its bytes, not a Python float per pixel."""
    images = np.random.default_rng(seed).integers(0, 17, size=(rows, 1, 8, 8))
    data = images.astype("<f4").tobytes()
    image = {"name": "image", "shape": [rows, 1, 8, 8], "datatype": "FP32"}
    header = json.dumps(
        {
            "inputs": [{**image, "parameters": {"binary_data_size": len(data)}}],
            "outputs": [{"name": "label", "parameters": {"binary_data": True}}],
        }
    ).encode()
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    return header + data, headers


def text_call(texts: int) -> Call:
    text = {"name": "text", "shape": [texts], "datatype": "BYTES", "data": [LONG_TEXT] * texts}
    return json.dumps({"inputs": [text]}).encode(), {"Content-Type": "application/json"}


async def post_all(url: str, path: str, calls: list[Call]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=CONNECTIONS)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.gather(
            *(client.post(path, content=body, headers=headers) for body, headers in calls)
        )


def largest_batch(url: str, model: str) -> float:
    """The smallest batch-size bucket bound that holds every batch the model ran."""
    text = httpx.get(f"{url}/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    buckets = sorted(
        (float(sample.labels["le"]), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "nograd_batch_size_bucket" and sample.labels["model"] == model
    )
    total = buckets[-1][1]
    return next(bound for bound, count in buckets if count >= total)


def peak_under_load(server: Server, path: str, first: Call, waves: list[list[Call]]) -> int:
    """Bytes the server's resident set rose above its idle level while it served ``waves``, one
    wave of concurrent requests after another; every request must answer 200. ``first``, a
    one-row request, runs before the idle level is read: the serving path (connections, codecs,
    the batcher) is then warm, and the rise is the larger batches'."""
    process = ResidentPeak(pid=str(server.process.pid))
    assert asyncio.run(post_all(server.url, path, [first]))[0].status_code == 200
    assert process.reset(), "the server's resident high-water mark cannot be reset here"
    idle = process.resident_bytes()
    for wave in waves:
        for response in asyncio.run(post_all(server.url, path, wave)):
            assert response.status_code == 200, response.text
    return process.high_water_bytes() - idle


def drive_digits_at_the_limit(server: Server, budget: int) -> int:
    limit = int(metric_value(server.url, "nograd_batch_limit", model="digits"))
    assert 1 <= limit < DIGITS_CAP, f"digits' limit {limit} did not shrink under the budget"
    # Requests of the limit (a batch each), of more (split across batches) and of one, from a
    # few callers at once.
    sizes = [limit, limit, limit + 3, 1]
    waves = [
        [digits_call(rows, 10 * wave + i) for i, rows in enumerate(sizes)] for wave in range(3)
    ]
    peak = peak_under_load(server, "/v2/models/digits/infer", digits_call(1, 99), waves)
    assert largest_batch(server.url, "digits") <= _bucket_at_least(limit)
    assert peak <= budget * (1 + FIT_MARGIN) + DIGITS_MARGIN, (
        f"digits at its limit of {limit}: resident peak {peak:,} B above idle, budget {budget:,} B"
    )
    return peak


def planned_fits(log: str) -> list[tuple[str, str, float]]:
    """(model, verdict, last check error in %) of every fit the plan logged."""
    found = re.findall(r"model (\S+) on \S+: cost model .*?; ([a-z-]+) \(check errors ([^)]*)", log)
    return [
        (model, verdict, float(errors.split(",")[-2].strip().rstrip("%")))
        for model, verdict, errors in found
    ]


def _bucket_at_least(rows: int) -> float:
    """The batch-size histogram's bound (powers of two) that a batch of ``rows`` falls under."""
    bound = 1.0
    while bound < rows:
        bound *= 2
    return bound


def forced(*engines: str) -> list[object]:
    """Engines forced, in ``make test-slow``: each start builds, checks and measures them anew,
    and ``auto`` (in ``make test``) already serves ONNX Runtime and eager side by side."""
    return [pytest.param(engine, marks=pytest.mark.slow) for engine in engines]


@pytest.mark.parametrize("engine", ["auto", *forced("onnx", "eager", "torch_export", "aoti")])
def test_a_small_budget_bounds_every_engine(serve: Serve, engine: str) -> None:
    # AOTInductor compiles minilm for minutes on 2 cores: digits alone shows it.
    models = ("digits",) if engine == "aoti" else ("digits", "minilm")
    with serve(engine, SMALL_BUDGET, *models) as server:
        log = server.log()
        plan = [r for r in server.records() if r["message"] == "memory plan for cpu"]
        assert plan and {r["budget_bytes"] for r in plan} == {SMALL_BUDGET}
        # The plan says which engine it measured for each range of batch sizes, and how well
        # its fit held at the check: none that plans a batch promised less than it used beyond
        # the tolerance.
        assert "nograd_model_memory_fit_error{" in httpx.get(f"{server.url}/metrics").text
        fits = planned_fits(log)
        assert {model for model, _, _ in fits} == set(models)
        for model, verdict, error in fits:
            assert verdict == "refused" or error >= -100 * FIT_TOLERANCE, (model, verdict, error)
        if engine != "auto":
            assert ("digits", "cpu", engine) in {
                (r["model"], r["device"], r["engine"]) for r in plan
            }
        if "minilm" in models:
            # minilm's one sequence does not fit: a clear 507, never a batch.
            assert metric_value(server.url, "nograd_batch_limit", model="minilm") == 0
            minilm = "/v2/models/minilm/infer"
            (response,) = asyncio.run(post_all(server.url, minilm, [text_call(1)]))
            assert response.status_code == 507, response.text
            assert "does not fit" in response.json()["error"]
        drive_digits_at_the_limit(server, SMALL_BUDGET)


@pytest.mark.parametrize("engine", ["auto", *forced("onnx", "eager", "torch_export")])
def test_minilm_at_its_limit_stays_within_its_budget(serve: Serve, engine: str) -> None:
    with serve(engine, MINILM_BUDGET, "minilm") as server:
        limit = int(metric_value(server.url, "nograd_batch_limit", model="minilm"))
        assert 256 <= limit < MINILM_CAP, f"minilm's limit {limit} did not shrink"
        texts = limit // 256
        # One request at a time, each a batch at the limit (or split into one and a rest): the
        # texts' tokenising, with several requests in flight, would add to the batches' peak.
        waves = [[text_call(texts)], [text_call(texts + 1)], [text_call(1)], [text_call(texts)]]
        peak = peak_under_load(server, "/v2/models/minilm/infer", text_call(1), waves)
        assert largest_batch(server.url, "minilm") <= _bucket_at_least(texts)
        assert peak <= MINILM_BUDGET * (1 + FIT_MARGIN) + MINILM_MARGIN, (
            f"minilm at its limit of {limit} tokens: resident peak {peak:,} B above idle"
        )
