"""What a running fleet is made of, kept in a file so later ``nograd fleet`` commands find it:
the balancer's process and socket, and each replica's slot, process and ports. One file per
balancer port under a run folder (``$XDG_RUNTIME_DIR`` or the ``--state-dir`` given)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_FOLDER = "nograd-fleet"


@dataclass
class Replica:
    """One nograd server of the fleet, in HAProxy's server slot ``replica<slot>``."""

    slot: int
    pid: int
    http_port: int
    grpc_port: int
    log: str


@dataclass
class Fleet:
    port: int
    """The balancer's HTTP port (its gRPC port is ``grpc_port``); the fleet's key."""
    grpc_port: int
    host: str
    balance: str
    slots: int
    balancer_pid: int
    socket: str
    folder: str
    """Where the fleet's logs and HAProxy's socket are."""
    replica_env: dict[str, str] = field(default_factory=dict)
    """The ``NOGRAD_*`` settings the replicas were started with: a restart or a new replica
    gets the same."""
    replicas: list[Replica] = field(default_factory=list)

    def replica(self, slot: int) -> Replica:
        (found,) = [replica for replica in self.replicas if replica.slot == slot]
        return found

    def free_slots(self) -> list[int]:
        taken = {replica.slot for replica in self.replicas}
        return [slot for slot in range(1, self.slots + 1) if slot not in taken]


def state_root(state_dir: Path | None) -> Path:
    """The folder fleets are recorded in: ``state_dir`` if given, else the user's run folder
    (``$XDG_RUNTIME_DIR``), else one under the temporary folder named by the user's id."""
    if state_dir is not None:
        return state_dir
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / STATE_FOLDER
    return Path(tempfile.gettempdir()) / f"{STATE_FOLDER}-{os.getuid()}"


def state_path(root: Path, port: int) -> Path:
    return root / f"{port}.json"


def save(fleet: Fleet, path: Path) -> None:
    """Write ``fleet`` whole (a new file renamed over the old one), readable by its user only:
    the replicas' settings may hold API keys."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = path.with_suffix(".partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        json.dump(asdict(fleet), out, indent=2)
    partial.replace(path)


def load(path: Path) -> Fleet:
    document: dict[str, Any] = json.loads(path.read_text())
    replicas = [Replica(**replica) for replica in document.pop("replicas")]
    return Fleet(**document, replicas=replicas)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return status.rsplit(")", 1)[-1].split()[0] != "Z"
