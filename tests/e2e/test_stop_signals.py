"""Stop signals as operators send them: to the whole process group (``kill -- -PGID``, systemd's
``KillMode=control-group``, a terminal's Ctrl+C) and through make, with requests in flight: every
accepted request is answered, on a new connection or one kept alive from before the stop."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import signal
import sys
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

from tests.e2e.serving import (
    ROOT,
    SLOW_BODY,
    Server,
    run_server,
    until_accepted,
    wait_until_accepted,
)

pytestmark = pytest.mark.e2e
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
IN_FLIGHT = 16
SLOW_PATH = "/v2/models/slow/infer"
EMBEDDINGS_PATH = "/v1/embeddings"
EMBEDDINGS_BODY = {"model": "minilm", "input": "The quick brown fox jumps over the lazy dog"}


def slow_repository(root: Path) -> Path:
    repo = root / "repo"
    shutil.copytree(FIXTURES / "slow", repo / "slow")
    config = repo / "slow" / "config.toml"
    config.write_text(config.read_text().replace("max_queue_size = 4", "max_queue_size = 64"))
    return repo


def env_for(root: Path, workers: int, fronts: int = 0) -> dict[str, str]:
    """``fronts``: one engine and that many front processes (``workers`` is then 1)."""
    return {
        "NOGRAD_WORKERS": str(workers),
        "NOGRAD_FRONTS": str(fronts),
        "NOGRAD_MODEL_REPOSITORY": str(slow_repository(root)),
        "NOGRAD_DRAIN_TIMEOUT_S": "30",
        "NOGRAD_LOG_FORMAT": "text",
        # Every request queued, however slow a busy machine makes the batches: the 503s here are
        # the drain's (Connection: close), not the queue-wait bound's, which has tests of its own.
        "NOGRAD_MAX_QUEUE_WAIT_S": "60",
    }


def signal_group_under_load(server: Server, sig: int, *, copy_to_leader: bool) -> list[int]:
    """``IN_FLIGHT`` requests on separate connections (so every worker holds some), then ``sig``
    to the server's process group (and a copy to the group leader, as make passes SIGTERM on);
    the status of every request."""

    async def wave() -> list[int]:
        limits = httpx.Limits(max_connections=IN_FLIGHT)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            calls = [
                asyncio.ensure_future(client.post("/v2/models/slow/infer", json=SLOW_BODY))
                for _ in range(IN_FLIGHT)
            ]
            await until_accepted(server.url, IN_FLIGHT)  # most still queued
            os.killpg(server.process.pid, sig)
            if copy_to_leader:
                await asyncio.sleep(0.005)
                os.kill(server.process.pid, sig)
            answers = await asyncio.gather(*calls, return_exceptions=True)
        return [a.status_code if isinstance(a, httpx.Response) else -1 for a in answers]

    return asyncio.run(wave())


@pytest.mark.parametrize(
    ("workers", "fronts", "sig"),
    [
        (2, 0, signal.SIGTERM),
        (2, 0, signal.SIGINT),
        (1, 0, signal.SIGTERM),
        (1, 0, signal.SIGINT),
        (1, 2, signal.SIGTERM),
    ],
    ids=[
        "two-workers-sigterm",
        "two-workers-ctrl-c",
        "one-process-sigterm",
        "one-process-ctrl-c",
        "engine-and-fronts-sigterm",
    ],
)
def test_a_signal_to_the_process_group_drains_every_request(
    tmp_path: Path, workers: int, fronts: int, sig: int
) -> None:
    with run_server(tmp_path, env_for(tmp_path, workers, fronts)) as server:
        started = time.monotonic()
        statuses = signal_group_under_load(server, sig, copy_to_leader=sig == signal.SIGTERM)
        assert server.process.wait(30) == 0, server.log()
        log = server.log()
    assert statuses == [200] * IN_FLIGHT, log
    assert time.monotonic() - started < 15
    name = signal.Signals(sig).name
    assert f"{name}: draining" in log
    assert "exiting without waiting" not in log and "killing the workers" not in log
    if workers > 1:
        assert log.count("told to stop by the supervisor") == workers
        assert "all workers stopped" in log
    if fronts:
        # The fronts drain first; the engine answers what they forwarded and ends its drain
        # once they are gone (the processes' exits may then be seen in either order).
        assert log.count("told to stop by the supervisor") == 1
        engine_drained = log.index("drain finished in")
        for index in range(1, fronts + 1):
            assert log.index(f"front {index} drained") < engine_drained
        assert "all workers stopped" in log
    assert "Traceback" not in log


def test_sigterm_to_make_and_its_server_drains_every_request(tmp_path: Path) -> None:
    """``make run`` in a process group that gets SIGTERM: make passes its copy on to nograd,
    which gets its own too; one stop, no request lost."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    with run_server(tmp_path, env_for(tmp_path, 2), command=make_command(tmp_path)) as server:
        statuses = signal_group_under_load(server, signal.SIGTERM, copy_to_leader=False)
        server.process.wait(30)
        log = server.log()
    assert statuses == [200] * IN_FLIGHT, log
    assert "SIGTERM: draining" in log
    assert "killing the workers" not in log
    assert log.count("told to stop by the supervisor") == 2
    assert "all workers stopped" in log


def make_command(root: Path) -> list[str]:
    """``make run`` as the Makefile runs it (make in the group, nograd its child)."""
    makefile = root / "Makefile"
    makefile.write_text(f"run:\n\t{sys.executable} -m nograd\n")
    return ["make", "--no-print-directory", "-f", str(makefile), "run"]


def wait_for_log(server: Server, text: str, count: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.log().count(text) < count:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.02)


def send(conn: http.client.HTTPConnection, path: str, body: Mapping[str, object]) -> None:
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})


def answer(conn: http.client.HTTPConnection) -> tuple[int | str, dict[str, str]]:
    """The status and headers of the response to the request sent last; the exception's name
    when the connection was reset or closed unanswered."""
    try:
        response = conn.getresponse()
        response.read()
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__, {}
    return response.status, {name.lower(): value for name, value in response.getheaders()}


def exchange(
    conn: http.client.HTTPConnection, path: str, body: Mapping[str, object]
) -> tuple[int | str, dict[str, str]]:
    """``answer`` to a request sent now; the exception's name when it could not be sent (the
    server closed the connection)."""
    try:
        send(conn, path, body)
    except OSError as exc:
        return type(exc).__name__, {}
    return answer(conn)


def kept_alive_through_a_stop(
    server: Server, path: str, body: Mapping[str, object], count: int
) -> tuple[list[tuple[int | str, dict[str, str]]], list[tuple[int | str, dict[str, str]]]]:
    """``count`` connections kept alive after one request each; then a request on half of them
    just before SIGTERM to the group (on their way when the stop comes), and one on the other
    half once every process drains and those are answered; the answers of each half."""
    host, port = server.url.removeprefix("http://").split(":")
    conns = [http.client.HTTPConnection(host, int(port), timeout=30) for _ in range(count)]
    try:
        for conn in conns:
            send(conn, path, body)
        assert [answer(conn)[0] for conn in conns] == [200] * count, server.log()
        before, after = conns[: count // 2], conns[count // 2 :]
        for conn in before:
            send(conn, path, body)
        # Read by the server before the stop (on a loaded machine its event loop may lag its
        # clients): a request whose head was not read yet would rightly be answered 503.
        model = str(body.get("model", "slow"))
        wait_until_accepted(server.url, count + len(before), model)
        os.killpg(server.process.pid, signal.SIGTERM)
        answered_before = [answer(conn) for conn in before]
        wait_for_log(server, "draining: not ready", count=2)
        # Nothing is in flight now: a drain that let idle connections go would be closing them.
        time.sleep(0.3)
        return answered_before, [exchange(conn, path, body) for conn in after]
    finally:
        for conn in conns:
            conn.close()


def assert_workers_stopped_cleanly(server: Server, exit_code: int = 0) -> None:
    assert server.process.wait(30) == exit_code, server.log()
    log = server.log()
    assert log.count("stopped with code 0") == 2, log
    assert "no worker could take" not in log and "Traceback" not in log, log


def test_requests_on_connections_kept_alive_through_a_stop_are_answered(tmp_path: Path) -> None:
    """A client's kept-alive connections when SIGTERM reaches the group: a request on its way
    then is served, one sent during the drain is answered 503, and each response ends its
    connection, so the client opens a new one instead of sending on a closing one."""
    with run_server(tmp_path, env_for(tmp_path, 2)) as server:
        before, after = kept_alive_through_a_stop(server, SLOW_PATH, SLOW_BODY, count=8)
        assert_workers_stopped_cleanly(server)
    assert [status for status, _ in before] == [200] * 4, before
    assert [status for status, _ in after] == [503] * 4, after
    # A request answered during the drain ends its connection (one answered before the stop
    # reached its worker may keep it: that connection is then idle, and waited for).
    for _, headers in after:
        assert headers["connection"] == "close", headers
    assert all(headers["retry-after"] for _, headers in after), after


Outcome = tuple[int | str, dict[str, str]]


def steady_stream(
    server: Server,
    path: str,
    body: Mapping[str, object],
    *,
    total: int = 300,
    concurrency: int = 32,
    stop_after_s: float = 1.0,
) -> list[Outcome]:
    """``total`` requests from ``concurrency`` clients on kept-alive connections, with SIGTERM
    to the server's process group ``stop_after_s`` in; each request's status (or exception)."""

    async def stream() -> list[Outcome]:
        outcomes: list[Outcome] = []
        left = total
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:

            async def one_client() -> None:
                nonlocal left
                while left > 0:
                    left -= 1
                    try:
                        response = await client.post(path, json=body)
                    except httpx.HTTPError as exc:
                        outcomes.append((type(exc).__name__, {}))
                    else:
                        outcomes.append((response.status_code, dict(response.headers)))

            async def stop() -> None:
                await asyncio.sleep(stop_after_s)
                os.killpg(server.process.pid, signal.SIGTERM)

            await asyncio.gather(stop(), *(one_client() for _ in range(concurrency)))
        return outcomes

    return asyncio.run(stream())


def assert_every_accepted_request_answered(outcomes: list[Outcome], total: int) -> Counter[str]:
    """Each request served, answered 503 with Retry-After and ``Connection: close``, or refused
    by the kernel once the port closed (ConnectError); never reset or left unanswered."""
    counts = Counter(str(status) for status, _ in outcomes)
    assert len(outcomes) == total
    assert set(counts) <= {"200", "503", "ConnectError"}, counts
    for status, headers in outcomes:
        if status == 503:
            assert headers.get("retry-after") and headers.get("connection") == "close", headers
    return counts


def test_a_steady_stream_stopped_midway_loses_no_accepted_request(tmp_path: Path) -> None:
    with run_server(tmp_path, env_for(tmp_path, 2)) as server:
        outcomes = steady_stream(server, SLOW_PATH, SLOW_BODY)
        assert_workers_stopped_cleanly(server)
    counts = assert_every_accepted_request_answered(outcomes, 300)
    assert counts["200"] > 0 and counts["503"] > 0, counts


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["sixteen", "kept-alive", "stream"])
def test_a_stop_of_make_run_with_minilm_loses_no_accepted_request(
    tmp_path: Path, scenario: str
) -> None:
    """The shipped models under ``make run`` with two workers, SIGTERM to the group: sixteen
    embedding requests on sixteen connections (stopped 0.4 s after they were sent), kept-alive
    connections, and a steady stream of 300 requests from 32 clients."""
    env = {
        "NOGRAD_WORKERS": "2",
        "NOGRAD_MODEL_REPOSITORY": str(ROOT / "models"),
        "NOGRAD_LOG_FORMAT": "text",
    }
    command = make_command(tmp_path)
    stopped_make = -signal.SIGTERM  # make passes SIGTERM on, then ends by it
    with run_server(tmp_path, env, command=command, ready_timeout_s=600) as server:
        if scenario == "kept-alive":
            before, after = kept_alive_through_a_stop(
                server, EMBEDDINGS_PATH, EMBEDDINGS_BODY, count=16
            )
            assert_workers_stopped_cleanly(server, stopped_make)
            outcomes = before + after
            assert all(headers.get("connection") == "close" for _, headers in after), after
        elif scenario == "stream":
            outcomes = steady_stream(server, EMBEDDINGS_PATH, EMBEDDINGS_BODY)
            assert_workers_stopped_cleanly(server, stopped_make)
        else:
            outcomes = steady_stream(
                server, EMBEDDINGS_PATH, EMBEDDINGS_BODY, total=16, concurrency=16, stop_after_s=0.4
            )
            assert_workers_stopped_cleanly(server, stopped_make)
    counts = assert_every_accepted_request_answered(outcomes, len(outcomes))
    assert "ConnectError" not in counts or scenario == "stream", counts
