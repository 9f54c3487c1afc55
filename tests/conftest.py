"""Settings every test starts from, unless it sets its own."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# gRPC off by default in tests: servers the suite starts side by side would all want port 8001.
# Tests of gRPC set NOGRAD_GRPC_PORT to a free port.
os.environ.setdefault("NOGRAD_GRPC_PORT", "0")

# Eager torch by default: the shipped models' engine = "auto" builds and times engines at every
# start (seconds each), which the many servers this suite starts would pay over and over; it also
# keeps answers bit-for-bit the same across batch sizes, which several tests compare. The engine
# tests (tests/unit/runtime/engines, tests/e2e/test_engines.py) set their own.
os.environ.setdefault("NOGRAD_ENGINE", "eager")

# One engine cache for the whole run, every parallel worker's servers included (they inherit this
# environment): a server of models an earlier one served opens its engines and plans from its
# memory profiles instead of measuring them again, and no run reads what an earlier run left.
# Tests of the cache itself (a cold start, a restart reusing it) set their own.
if "NOGRAD_ENGINE_CACHE" not in os.environ:
    _ENGINE_CACHE = tempfile.mkdtemp(prefix="nograd-test-engines-")
    os.environ["NOGRAD_ENGINE_CACHE"] = _ENGINE_CACHE
    atexit.register(shutil.rmtree, _ENGINE_CACHE, ignore_errors=True)

# In a parallel run's workers (pytest-xdist), a server's OpenMP threads yield the core as soon as
# a batch ends instead of spinning for the next one (the server's default with one process): the
# spin takes the core the other worker's server needs. The serial pass keeps the default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("GOMP_SPINCOUNT", "0")


# Imported after the defaults above are set: the e2e helpers read no settings at import.
from collections.abc import Iterator

import pytest

from tests.e2e.serving import Server, free_port, run_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real server with the shipped models, HTTP and gRPC (on a free port), started once and
    shared by every test that only reads from it: each start costs the models' loading."""
    env = {"NOGRAD_GRPC_PORT": str(free_port())}
    with run_server(tmp_path_factory.mktemp("server"), env) as running:
        yield running


@pytest.fixture(scope="session")
def server_url(server: Server) -> str:
    return server.url


SERIAL: frozenset[str] = frozenset(
    {
        # Memory bounds: a server's growth, peak or budget measured against a bound, which a
        # neighbour's load moves (slower batches hold more requests, the free memory differs).
        "tests/e2e/test_body_budget.py",
        "tests/e2e/test_grpc_unsent_answers.py",
        "tests/e2e/test_memory.py",
        "tests/e2e/test_memory_engines.py",
        "tests/e2e/test_memory_return.py",
        "tests/e2e/test_model_control_memory.py",
        "tests/e2e/test_on_demand.py",
        "tests/e2e/test_on_demand_many.py",
        "tests/e2e/test_on_demand_thrash.py",
        # Latency, overload and time bounds of a second or less: timeouts to the second, a tail
        # latency, a refusal "at once", a stop within seconds.
        "tests/e2e/test_connections.py",
        "tests/e2e/test_grpc_connections.py",
        "tests/e2e/test_on_demand_routes.py",
        "tests/e2e/test_overload.py",
        "tests/e2e/test_overload_minilm.py",
        "tests/e2e/test_reliability.py",
        "tests/e2e/test_stop_signals.py",
        "tests/e2e/test_trace_otlp_down.py",
        "tests/e2e/test_workers.py",
        "tests/integration/test_perf_analyzer.py",
        "tests/integration/test_prometheus.py",
        "tests/unit/batching/test_batcher.py",
        "tests/unit/batching/test_shedding.py",
        "tests/unit/grpc/test_tensors.py",
        "tests/unit/http/test_admission.py",
        "tests/unit/protocol/test_limits.py",
        # The server's own OpenMP wait policy, which the parallel pass's servers do not keep.
        "tests/e2e/test_server.py::test_a_single_process_keeps_openmp_threads_spinning",
    }
)
"""Test files (or tests) whose bounds hold only on a machine no other test loads: marked
``serial``, which ``make test`` runs after the parallel pass, one test at a time. Bounds of
several seconds on a refusal (``test_grpc``, ``test_model_uploads``) hold beside one other test
and stay parallel."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the ``SERIAL`` files' tests before ``-m`` selects by marker."""
    root = config.rootpath
    for item in items:
        if item.path.relative_to(root).as_posix() in SERIAL or item.nodeid in SERIAL:
            item.add_marker(pytest.mark.serial)
