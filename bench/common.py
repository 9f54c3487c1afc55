"""Shared plumbing: paths, free ports, CPU pinning and server processes that always get stopped."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cores() -> int:
    return os.cpu_count() or 1


def pinned(command: Sequence[str], cpus: str | None) -> list[str]:
    """``command`` under ``taskset -c cpus`` when pinning is asked for and possible."""
    if cpus is None or shutil.which("taskset") is None:
        return list(command)
    return ["taskset", "-c", cpus, *command]


def machine() -> dict[str, Any]:
    """What the results were measured on: core count first, as every table repeats it."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import torch

    from nograd.host.readings import gpu_visible, usable_cores
    from nograd.supervisor.plan import auto_fronts, auto_plan

    auto, auto_reason = auto_plan()
    fronts, fronts_reason = auto_fronts(usable_cores(), gpu_visible(), on_demand=False)
    return {
        "cores": cores(),
        "default_fronts": fronts,
        "default_fronts_reason": fronts_reason,
        "auto_workers": auto,
        "auto_workers_reason": auto_reason,
        "cpu": model or platform.processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_start": os.getloadavg(),
        "git": git_state(),
    }


def git_state() -> dict[str, Any]:
    def run(*args: str) -> str:
        try:
            out = subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip()

    dirty = run("status", "--short", "nograd", "models")
    return {"commit": run("rev-parse", "--short", "HEAD"), "code_dirty": bool(dirty)}


def code_hash() -> str:
    """Digest of nograd's code and model configs as they are on disk now.

    A server started later in the run imports whatever is on disk then; comparing digests tells
    whether every nograd server of a run served the same code.
    """
    import hashlib

    digest = hashlib.sha256()
    models = ROOT / "models"
    files = sorted(
        [*(ROOT / "nograd").rglob("*.py"), *models.rglob("*.py"), *models.rglob("*.toml")]
    )
    for path in files:
        with contextlib.suppress(OSError):
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def percentile(values: Sequence[float], fraction: float) -> float:
    """The value below which ``fraction`` of ``values`` fall (nearest rank, no interpolation)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def http_post(url: str, body: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
    return http_send(url, body, timeout=timeout)


def http_send(
    url: str,
    body: bytes,
    *,
    method: str = "POST",
    content_type: str = "application/json",
    timeout: float = 30.0,
) -> tuple[int, bytes]:
    """One request with ``body``: its status and answer, an HTTP error's included."""
    request = urllib.request.Request(
        url, data=body, method=method, headers={"content-type": content_type}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


@dataclass
class Server:
    """A server process in its own session, so stopping it reaches every child it spawned."""

    name: str
    command: list[str]
    ready_path: str
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: str | None = None
    port: int = field(default_factory=free_port)
    grpc_port: int | None = None  # nograd's gRPC port, where it serves gRPC
    pausable: bool = True
    """False for a server that does not survive SIGSTOP: it stays running, idle, and any CPU it
    takes shows as foreign CPU in the measured server's run."""
    peer: str | None = None
    """The peer system (``bench.peers``) this server is, when its route or body format differs
    from nograd's V2 JSON; None for nograd and the baselines that share its route."""
    log_path: Path | None = None
    cwd: Path = ROOT
    """Where the server starts: another revision's checkout runs its own ``python -m nograd``."""
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc_address(self) -> str:
        if self.grpc_port is None:
            raise ValueError(f"{self.name} serves no gRPC")
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, ready_timeout_s: float = 180.0) -> None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_path or RESULTS / f"server-{self.name}-{self.port}.log"
        env = {**os.environ, **self.env}
        command = [part.replace("{port}", str(self.port)) for part in self.command]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                pinned(command, self.cpus),
                cwd=self.cwd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError):
                status, _ = http_get(self.url + self.ready_path, timeout=2.0)
                if status == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {ready_timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGINT, then SIGKILL to the process group this server leads."""
        process = self.process
        if process is None or process.poll() is not None:
            self._reap_group()
            return
        self.resume()  # a paused group would hold the SIGTERM until continued
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGINT, 5.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            try:
                process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self._reap_group()

    def pause(self) -> None:
        """SIGSTOP to every process of the server's group, while another server is measured:
        an idle server that polls (LitServe's workers used 0.23 cores of 2 idle, measured)
        would take CPU from the one under load."""
        if self.pausable:
            self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)

    def _reap_group(self) -> None:
        # Children (LitServe's workers) may outlive their leader: the group id is still ours.
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def __enter__(self) -> Server:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_only(server: Server | None, everyone: Sequence[Server]) -> None:
    """Resume ``server`` and pause every other one of ``everyone`` (SIGSTOP): only the server
    under load takes CPU. ``None`` (a raw-forward measurement) pauses them all."""
    for other in everyone:
        if other is server:
            other.resume()
        else:
            other.pause()


AS_SHIPPED = {"NOGRAD_WORKERS": "auto", "NOGRAD_FRONTS": "auto"}
"""``nograd_server``'s ``extra_env`` for the processes ``make run`` starts (the defaults)."""


def nograd_server(
    repository: Path, cpus: str | None, extra_env: Mapping[str, str] | None = None
) -> Server:
    """nograd exactly as users start it: the ``nograd`` command with NOGRAD_* settings, one
    process unless ``extra_env`` asks for more (``AS_SHIPPED``: the processes ``make run``
    starts, planned per machine; the report says which). gRPC is on, as by default, on a free
    port of its own: servers that are up together (the paired rounds) cannot all have 8001."""
    env = {
        "NOGRAD_HOST": "127.0.0.1",
        "NOGRAD_WORKERS": "1",
        "NOGRAD_MODEL_REPOSITORY": str(repository),
        "NOGRAD_LOG_LEVEL": "warning",
        # The benchmark stops servers between phases; no drain wait is wanted there.
        "NOGRAD_DRAIN_TIMEOUT_S": "0",
        "NOGRAD_GRPC_PORT": str(free_port()),
        **(extra_env or {}),
    }
    server = Server(
        "nograd",
        [str(Path(PYTHON).parent / "nograd")],
        "/v2/health/ready",
        env=env,
        cpus=cpus,
        grpc_port=int(env["NOGRAD_GRPC_PORT"]) or None,
    )
    server.env = {**env, "NOGRAD_PORT": str(server.port)}
    return server


def scrape_metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text → {(name, sorted labels): value}."""
    status, body = http_get(url + "/metrics", timeout=5.0)
    if status != 200:
        return {}
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        pairs: list[tuple[str, str]] = []
        for item in labels.rstrip("}").split(","):
            if "=" in item:
                key, _, val = item.partition("=")
                pairs.append((key, val.strip('"')))
        with contextlib.suppress(ValueError):
            found[(name, tuple(sorted(pairs)))] = float(value)
    return found


def metric(
    found: Mapping[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for (found_name, pairs), value in found.items():
        if found_name == name and set(labels.items()) <= set(pairs):
            total += value
    return total
