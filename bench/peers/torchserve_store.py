"""TorchServe serving a model store as its users start it: ``torchserve --start --foreground``
with a ``config.properties`` that loads every archive of the store, each with the batching and
workers its own ``model-config.yaml`` asks for.

Every listener binds 127.0.0.1 on a free port (its gRPC ones default to 7070/7071, which a second
instance could not bind), token authorisation is off, no config snapshot is written (``--ncs``),
and logs, metrics logs and TorchServe's pid file live in a folder of the caller's (TorchServe
refuses to start beside another instance sharing its temp folder's pid file).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import Server, free_port


@dataclass(frozen=True)
class StorePorts:
    """The ports of one TorchServe instance besides its inference port."""

    inference: int
    management: int = field(default_factory=free_port)
    metrics: int = field(default_factory=free_port)
    worker: int = field(default_factory=free_port)
    grpc_inference: int = field(default_factory=free_port)
    grpc_management: int = field(default_factory=free_port)


def store_config(store: Path, ports: StorePorts) -> str:
    """``config.properties`` serving every archive of ``store`` with one worker by default (an
    archive's ``model-config.yaml`` overrides it), its system-metrics sampler off."""
    lines = [
        f"inference_address=http://127.0.0.1:{ports.inference}",
        f"management_address=http://127.0.0.1:{ports.management}",
        f"metrics_address=http://127.0.0.1:{ports.metrics}",
        f"initial_worker_port={ports.worker}",
        f"grpc_inference_port={ports.grpc_inference}",
        f"grpc_management_port={ports.grpc_management}",
        f"model_store={store}",
        "load_models=all",
        "default_workers_per_model=1",
        "disable_token_authorization=true",
        "install_py_dep_per_model=false",
        "disable_system_metrics=true",
    ]
    return "\n".join(lines) + "\n"


def store_command(python: Path, config: Path, store: Path) -> list[str]:
    """The ``torchserve`` of ``python``'s venv in the foreground on ``config`` and ``store``."""
    return [
        str(python.parent / "torchserve"),
        *("--start", "--foreground", "--ncs", "--disable-token-auth"),
        *("--ts-config", str(config), "--model-store", str(store)),
    ]


def store_env(python: Path, folder: Path) -> dict[str, str]:
    """TorchServe's environment: its venv's ``bin`` first on PATH (the frontend starts the
    workers with the ``python`` it finds there), logs and pid file under ``folder``."""
    return {
        "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "LOG_LOCATION": str(folder / "logs"),
        "METRICS_LOCATION": str(folder / "logs"),
        "TMPDIR": str(folder),
    }


def torchserve_store_server(
    python: Path, store: Path, folder: Path, cpus: str | None = None, name: str = "torchserve"
) -> Server:
    """A ``Server`` running TorchServe on ``store``, its config and logs in ``folder``; ready when
    ``/ping`` is healthy (its models may still be loading: callers wait for an answer)."""
    folder.mkdir(parents=True, exist_ok=True)
    server = Server(name, [], "/ping", cpus=cpus)
    config = folder / "config.properties"
    config.write_text(store_config(store, StorePorts(inference=server.port)), "utf-8")
    server.command = store_command(python, config, store)
    server.env = store_env(python, folder)
    return server
