"""Stop signals as operators send them: to the whole process group (``kill -- -PGID``, systemd's
``KillMode=control-group``, a terminal's Ctrl+C) and through make, with requests in flight: every
accepted request is answered."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.serving import SLOW_BODY, Server, run_server, until_accepted

pytestmark = pytest.mark.e2e
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
IN_FLIGHT = 16


def slow_repository(root: Path) -> Path:
    repo = root / "repo"
    shutil.copytree(FIXTURES / "slow", repo / "slow")
    config = repo / "slow" / "config.toml"
    config.write_text(config.read_text().replace("max_queue_size = 4", "max_queue_size = 64"))
    return repo


def env_for(root: Path, workers: int) -> dict[str, str]:
    return {
        "NOGRAD_WORKERS": str(workers),
        "NOGRAD_MODEL_REPOSITORY": str(slow_repository(root)),
        "NOGRAD_DRAIN_TIMEOUT_S": "30",
        "NOGRAD_LOG_FORMAT": "text",
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
    ("workers", "sig"),
    [(2, signal.SIGTERM), (2, signal.SIGINT), (1, signal.SIGTERM), (1, signal.SIGINT)],
    ids=["two-workers-sigterm", "two-workers-ctrl-c", "one-process-sigterm", "one-process-ctrl-c"],
)
def test_a_signal_to_the_process_group_drains_every_request(
    tmp_path: Path, workers: int, sig: int
) -> None:
    with run_server(tmp_path, env_for(tmp_path, workers)) as server:
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
    assert "Traceback" not in log


def test_sigterm_to_make_and_its_server_drains_every_request(tmp_path: Path) -> None:
    """``make run`` in a process group that gets SIGTERM: make passes its copy on to nograd,
    which gets its own too; one stop, no request lost."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    makefile = tmp_path / "Makefile"
    makefile.write_text(f"run:\n\t{sys.executable} -m nograd\n")
    command = ["make", "--no-print-directory", "-f", str(makefile), "run"]
    with run_server(tmp_path, env_for(tmp_path, 2), command=command) as server:
        statuses = signal_group_under_load(server, signal.SIGTERM, copy_to_leader=False)
        server.process.wait(30)
        log = server.log()
    assert statuses == [200] * IN_FLIGHT, log
    assert "SIGTERM: draining" in log
    assert "killing the workers" not in log
    assert log.count("told to stop by the supervisor") == 2
    assert "all workers stopped" in log
