"""On-demand control with an ensemble, through a real server: a request to the ensemble holds
its step models for its whole life, so a load that needs room while the request runs waits for
it instead of evicting the step it has still to run; and a request to an ensemble whose step
models were evicted loads them again, each counted as its own load."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.serving import Server, metric_value, run_server
from tests.e2e.test_on_demand import MODEL_MIB, answer_of, infer, write_model

pytestmark = pytest.mark.e2e

LIMIT_MIB = 24
"""Two models of 8 MiB, not three: each holds 9 to 11.5 MiB once loaded (its smallest batches,
and what a first load of its code allocates besides: fast at 11.3 MiB and slow at 9.2 MiB did
not fit 20 MiB together)."""
SLOW_S = 2.0

ENSEMBLE = """
name: "chain"
platform: "ensemble"
max_batch_size: 4
input [ { name: "x", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "slow"
      model_version: -1
      input_map { key: "x" value: "x" }
      output_map { key: "y" value: "middle" }
    },
    {
      model_name: "fast"
      model_version: -1
      input_map { key: "x" value: "middle" }
      output_map { key: "y" value: "y" }
    }
  ]
}
"""
"""``slow`` (adds 10, taking ``SLOW_S``) then ``fast`` (adds 20): loaded in name order, ``fast``
is the least recently used step while ``slow`` runs."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("repository")
    write_model(repo, "slow", MODEL_MIB, 10)
    code = repo / "slow" / "model.py"
    code.write_text(
        code.read_text().replace(
            "        return x + self.table[0]",
            # Slow for requests (x = 0.5) only, not for the probes of its load.
            "        if bool((x == 0.5).any()):\n"
            f"            __import__('time').sleep({SLOW_S})\n"
            "        return x + self.table[0]",
        )
    )
    write_model(repo, "fast", MODEL_MIB, 20)
    write_model(repo, "m1", MODEL_MIB, 1)
    (repo / "chain" / "1").mkdir(parents=True)
    (repo / "chain" / "config.pbtxt").write_text(ENSEMBLE)
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_MODEL_CONTROL": "on_demand",
        "NOGRAD_MEMORY_LIMIT_BYTES": f"{LIMIT_MIB}MiB",
        "NOGRAD_MAX_QUEUE_WAIT_S": "30",
    }
    with run_server(tmp_path_factory.mktemp("log"), env) as running:
        yield running


def chain_answer(client: httpx.Client) -> None:
    answer = infer(client, "chain", 0.5)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [30.5]


def test_an_ensemble_request_holds_its_steps_and_loads_them(server: Server) -> None:
    url = server.url
    with (
        httpx.Client(base_url=url, timeout=60) as client,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        answer_of(client, 1)  # measured: its next load makes its room before it starts
        started = time.monotonic()
        chain_answer(client)  # loads both steps (evicting m1), then the ensemble
        # Its second step's load does not wait for the first step, which this very request
        # holds (it could only wait out the room wait, NOGRAD_MAX_QUEUE_WAIT_S).
        assert metric_value(url, "nograd_model_load_wait_seconds_count", model="slow") >= 1
        assert metric_value(url, "nograd_model_load_wait_seconds_sum", model="slow") < 10
        assert time.monotonic() - started < 20
        assert metric_value(url, "nograd_model_loads_total", model="fast") == 1
        assert metric_value(url, "nograd_model_loads_total", model="slow") == 1

        # While the ensemble runs its slow step, a load needs the room of one step: it waits
        # for the ensemble's answer rather than evicting ``fast`` from under it.
        running = pool.submit(chain_answer, client)
        time.sleep(SLOW_S / 4)
        loading = pool.submit(answer_of, client, 1)
        running.result()
        loading.result()
        assert metric_value(url, "nograd_model_evictions_total", reason="memory") >= 1

        # The ensemble again, a step of it evicted: the step loads on demand, as its own load.
        chain_answer(client)
        loads = metric_value(url, "nograd_model_loads_total", model="fast") + metric_value(
            url, "nograd_model_loads_total", model="slow"
        )
        assert loads >= 3  # each step's loads counted, the one evicted loaded again
        assert infer(client, "m1").status_code == 200
