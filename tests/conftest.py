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
# Tests of the cache itself (a cold start, a restart reusing it) set their own. ``make test`` gives
# both of its passes one cache, so the serial pass's servers reuse the first pass's measurements.
if "NOGRAD_ENGINE_CACHE" not in os.environ:
    _ENGINE_CACHE = tempfile.mkdtemp(prefix="nograd-test-engines-")
    os.environ["NOGRAD_ENGINE_CACHE"] = _ENGINE_CACHE
    atexit.register(shutil.rmtree, _ENGINE_CACHE, ignore_errors=True)


# Imported after the defaults above are set: the e2e helpers read no settings at import.
from collections.abc import Iterator

import pytest

from tests.e2e.serving import Server, free_port, run_server

# In a parallel run's workers (pytest-xdist), a server's OpenMP threads yield the core as soon as
# a batch ends instead of spinning for the next one (the server's default with one process): the
# spin takes the core the other worker's server needs. The serial pass keeps the default.
OPERATOR_SET_OPENMP_WAIT = "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ
"""Whether the environment the suite started in set the OpenMP wait policy itself, which a server
keeps (the suite's own setting below is taken out again by the test of the server's default)."""
if os.environ.get("PYTEST_XDIST_WORKER") and not OPERATOR_SET_OPENMP_WAIT:
    os.environ["GOMP_SPINCOUNT"] = "0"


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
        # Memory bounds beside a latency or time bound: a body refused "at once" while the
        # event loop answers health checks, memory handed back within seconds, a hot model's
        # latency under name cycling.
        "tests/e2e/test_body_budget.py",
        "tests/e2e/test_memory_return.py",
        "tests/e2e/test_on_demand_thrash.py",
        # Batches large enough to run out of the injected memory form only while no other
        # test takes the CPU (a busy neighbour leaves them too small to split).
        "tests/e2e/test_memory.py::test_out_of_memory_splits_batches_and_loses_no_request",
        # A second worker started only while another copy of the models fits the free memory.
        "tests/e2e/test_workers.py::test_auto_starts_the_workers_it_plans_and_logs_their_memory",
        # Latency, overload and time bounds of a second or less: timeouts to the second, a tail
        # latency, a refusal "at once", a stop within seconds, a health check read 0.15 s after
        # a stop.
        "tests/e2e/test_connections.py",
        "tests/e2e/test_grpc_connections.py",
        "tests/e2e/test_on_demand_routes.py",
        "tests/e2e/test_overload.py",
        "tests/e2e/test_overload_minilm.py",
        "tests/e2e/test_reliability.py::test_deadline_passed_in_queue_is_504_without_compute",
        "tests/e2e/test_reliability.py::test_sigterm_drains_accepted_requests",
        "tests/e2e/test_reliability.py::test_a_stop_answers_connections_accepted_before_it",
        "tests/e2e/test_reliability.py::test_ctrl_c_during_the_drain_exits_without_waiting",
        "tests/e2e/test_reliability.py::test_request_ids_and_header_deadlines",
        "tests/e2e/test_reliability.py::test_client_that_disconnects_cancels_its_queued_work",
        "tests/e2e/test_trace_otlp_down.py",
        # A stream of 300 requests from 32 clients stopped one second in.
        "tests/e2e/test_stop_signals.py::test_a_steady_stream_stopped_midway_loses_no_accepted_request",
        "tests/e2e/test_workers.py::test_ctrl_c_during_the_drain_stops_the_workers_without_waiting",
        "tests/integration/test_perf_analyzer.py",
        "tests/integration/test_prometheus.py",
        "tests/unit/batching/test_batcher.py",
        "tests/unit/batching/test_shedding.py",
        "tests/unit/grpc/test_tensors.py",
        "tests/unit/http/test_admission.py",
        "tests/unit/protocol/test_limits.py",
        # Connections handed out one by one, counted exactly per worker: a close the supervisor
        # has not seen yet on a loaded machine moves one.
        "tests/e2e/test_workers.py::test_workers_share_the_port_metrics_and_restarts",
    }
)
"""Test files, or tests (``path::function``, every parametrization), whose bounds hold only on a
machine no other test loads: marked ``serial``, which ``make test`` runs after the parallel pass,
one test at a time. Bounds of several seconds on a refusal (``test_grpc``, ``test_model_uploads``)
hold beside one other test and stay parallel, as do bounds that are about what the server does
rather than how fast: every request of a stop answered (``test_stop_signals``), the memory a
reload or an out-of-memory split leaves (``test_model_control_memory``, ``test_memory``), a
guarded server's refusals (``test_reliability``'s module server), and memory bounds a server
keeps whatever its speed: explicit budgets and limits, clients bounded in number, each reading
its own process's memory (``test_memory_engines``, ``test_on_demand``, ``test_on_demand_many``,
``test_grpc_unsent_answers``)."""


WAITING: frozenset[str] = frozenset(
    {
        # HAProxy's timers and health checks before three small Python replicas: 24 s, 4 s of CPU.
        "tests/integration/test_fleet_routing.py",
        # A stream's unsent answers held until its timeout, requests paced: 25 s, 4 s of CPU.
        "tests/e2e/test_grpc_unsent_answers.py",
        # Steps that wait out graces and a slow model: 10 s, 4 s of CPU.
        "tests/e2e/test_on_demand_ensembles.py",
    }
)
"""Test files that mostly wait (timers, paced clients) and bound nothing tighter than the
parallel pass's tests do: marked ``waiting``, which ``make test`` runs in a lane of its own
beside the parallel pass, so that their waits do not hold one of its two workers."""


LONGEST_FIRST: tuple[str, ...] = (
    "tests/e2e/test_engines.py",
    "tests/e2e/test_fleet.py",
    "tests/unit/runtime/engines/test_export.py",
    "tests/e2e/test_model_control.py",
    "tests/e2e/test_grpc.py",
    "tests/e2e/test_fronts.py",
    "tests/e2e/test_triton_examples.py",
    "tests/e2e/test_model_uploads.py",
    "tests/e2e/test_memory_engines.py",
    "tests/e2e/test_stop_signals.py",
    "tests/e2e/test_triton_repository.py",
    "tests/e2e/test_torchserve.py",
    "tests/e2e/test_shared_memory.py",
    "tests/unit/runtime/engines/test_choice.py",
    "tests/e2e/test_model_control_restart.py",
    "tests/e2e/test_operator_keys.py",
    "tests/e2e/test_fuzz.py",
    "tests/e2e/test_server.py",
    "tests/e2e/test_workers.py",
    "tests/e2e/test_trace_workers.py",
    "tests/e2e/test_trace_logging.py",
    "tests/unit/models/test_minilm.py",
    "tests/unit/serving/test_fair_budget.py",
    "tests/e2e/test_metrics_auth.py",
    "tests/e2e/test_on_demand_many.py",
    "tests/e2e/test_on_demand.py",
    "tests/e2e/test_model_control_memory.py",
    "tests/e2e/test_grpc_health_flood.py",
    "tests/unit/runtime/engines/test_registry.py",
    "tests/e2e/test_reliability.py",
    "tests/e2e/test_memory.py",
)
"""The parallel pass's longest files, longest first: it hands out whole files (``--dist
loadfile --no-loadscope-reorder``), in this order, then the rest in collection order; a long
file handed out last would keep one worker busy while the other waits."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the ``SERIAL`` files' and tests' items, and the ``WAITING`` files', before ``-m``
    selects by marker, and put the ``LONGEST_FIRST`` files first."""
    root = config.rootpath
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    for item in items:
        path = item.path.relative_to(root).as_posix()
        function = getattr(item, "originalname", item.name)
        if path in SERIAL or f"{path}::{function}" in SERIAL:
            item.add_marker(pytest.mark.serial)
        if path in WAITING:
            item.add_marker(pytest.mark.waiting)
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))
