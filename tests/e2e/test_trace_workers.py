"""Trace and log settings with several workers (NOGRAD_WORKERS=2): a change sent to one worker is
in force on every worker when its call answers, each worker samples by the rate and count on its
own and writes its own trace file (``<trace_file>.w<pid>``), and a log switch reaches both."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.serving import run_server, worker_pids
from tests.triton_models import FIXTURES

pytestmark = pytest.mark.e2e

SIMPLE = {
    "inputs": [
        {"name": name, "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}
        for name in ("INPUT0", "INPUT1")
    ]
}
OFF = {"trace_level": None, "trace_rate": None, "trace_count": None, "log_frequency": None}


def _infer_on_new_connections(url: str, count: int, prefix: str) -> list[str]:
    """``count`` requests, each on a connection of its own (handed to either worker in turn);
    the request ids sent."""
    ids = [f"{prefix}-{index}" for index in range(count)]
    for request_id in ids:
        answer = httpx.post(
            f"{url}/v2/models/simple/infer",
            json=SIMPLE,
            headers={"X-Request-Id": request_id},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
    return ids


def _on_each_worker(url: str, path: str) -> list[dict[str, object]]:
    """A GET asked on two new connections in a row: one answered by each worker."""
    answers = []
    for _ in range(2):
        answer = httpx.get(f"{url}{path}", timeout=30)
        assert answer.status_code == 200, answer.text
        answers.append(answer.json())
    return answers


def _read_when_written(path: Path, timeout_s: float = 15.0) -> list[dict[str, object]]:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path} not written: {sorted(p.name for p in path.parent.iterdir())}"
    entries: list[dict[str, object]] = json.loads(path.read_text())
    return entries


def test_settings_reach_every_worker_and_each_writes_its_own_trace_file(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "simple", repo / "simple")
    trace_file = tmp_path / "trace.json"
    env = {
        "NOGRAD_WORKERS": "2",
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_TRACE_FILE": str(trace_file),
        "NOGRAD_LOG_FORMAT": "json",
    }
    with run_server(tmp_path, env, ready_timeout_s=180) as server:
        pids = sorted(worker_pids(server).values())
        assert len(pids) == 2
        # Sent to one worker; in force on both once answered.
        changed = httpx.post(
            f"{server.url}/v2/trace/setting",
            json={"trace_level": ["TIMESTAMPS"], "trace_rate": "2", "trace_count": "2"},
            timeout=30,
        )
        assert changed.status_code == 200, changed.text
        for setting in _on_each_worker(server.url, "/v2/trace/setting"):
            assert (setting["trace_level"], setting["trace_rate"]) == (["TIMESTAMPS"], "2")
            assert setting["trace_count"] == "2"
        # 10 requests, 5 on each worker: each samples its 2nd and 4th, then its count is spent.
        _infer_on_new_connections(server.url, 10, "traced")
        for setting in _on_each_worker(server.url, "/v2/trace/setting"):
            assert setting["trace_count"] == "0"
        for pid in pids:
            # The count ran out: the worker's traces go to its indexed file at once.
            entries = _read_when_written(tmp_path / f"trace.json.w{pid}.0")
            heads = [e for e in entries if "model_name" in e]
            assert len(heads) == 2, entries
            sampled = sorted(str(h["request_id"]) for h in heads)
            assert len({int(name.split("-")[1]) % 2 for name in sampled}) == 1  # one worker's
        assert not trace_file.exists()

        # A model's setting, sent to one worker, is that model's on both.
        model = httpx.post(
            f"{server.url}/v2/models/simple/trace/setting", json={"trace_rate": "3"}, timeout=30
        )
        assert model.status_code == 200, model.text
        for setting in _on_each_worker(server.url, "/v2/models/simple/trace/setting"):
            assert setting["trace_rate"] == "3"
        httpx.post(f"{server.url}/v2/models/simple/trace/setting", json=OFF, timeout=30)
        httpx.post(f"{server.url}/v2/trace/setting", json=OFF, timeout=30)
        for setting in _on_each_worker(server.url, "/v2/models/simple/trace/setting"):
            assert setting["trace_level"] == ["OFF"] and setting["trace_rate"] == "1000"

        # Debug lines on: every request logs its line, whichever worker answers it.
        verbose = httpx.post(f"{server.url}/v2/logging", json={"log_verbose_level": 1}, timeout=30)
        assert verbose.status_code == 200, verbose.text
        for setting in _on_each_worker(server.url, "/v2/logging"):
            assert setting["log_verbose_level"] == 1
        ids = _infer_on_new_connections(server.url, 6, "verbose")
        time.sleep(0.3)
        log = server.log()
        assert all(f'"request_id":"{request_id}"' in log for request_id in ids), log[-4000:]
        # And off again on both.
        httpx.post(f"{server.url}/v2/logging", json={"log_verbose_level": 0}, timeout=30)
        quiet = _infer_on_new_connections(server.url, 4, "quiet")
        time.sleep(0.3)
        log = server.log()
        assert not any(f'"request_id":"{request_id}"' in log for request_id in quiet)
