"""``python -m bench.peers.verify``: each peer set up, started, checked and briefly loaded.

The end-to-end proof that a peer works on this machine before the bench spends minutes on it:
its venv (built if missing), its server per model with the first configuration of its sweep, the
answer check of every workload it serves, a short closed-loop run with wrk at the bench's
concurrency (a smoke figure, not a measurement: no pairing, no repeats) and the server stopped in
a ``finally``. Prints one JSON document.

A run of more than a few seconds waits while ``--lock-file`` exists: another benchmark on the
machine would be disturbed by the load and would disturb the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from bench.loadgen import have_wrk, run_closed
from bench.peers.check import Reference, check_workload
from bench.peers.envs import ensure_env
from bench.peers.protocol import MODEL_OF_WORKLOAD, route, write_peer_bodies
from bench.peers.servers import ENV_OF_SYSTEM, MODELS_OF_SYSTEM, SWEEPS, PeerOptions, peer_server
from bench.workloads import ALL, make

SYSTEMS: Final = tuple(SWEEPS)
LOCK_POLL_S: Final = 10.0
LOCK_WAIT_LIMIT_S: Final = 1200.0
SHORT_RUN_S: Final = 3.0
READY_TIMEOUT_S: Final = 300.0


def wait_while_locked(
    lock: Path, poll_s: float = LOCK_POLL_S, limit_s: float = LOCK_WAIT_LIMIT_S
) -> bool:
    """Wait while ``lock`` exists; False when it was still there after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while lock.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def verify_system(
    system: str,
    reference: Reference,
    *,
    load_s: float,
    concurrency: int,
    lock: Path,
    all_options: bool = False,
) -> dict[str, Any]:
    """Set up, start, check and load one peer system for each model it serves, with the first
    configuration of its sweep (every configuration with ``all_options``)."""
    started = time.monotonic()
    env = ensure_env(ENV_OF_SYSTEM[system])
    report: dict[str, Any] = {
        "system": system,
        "env_seconds": round(env.seconds, 1),
        "env_installed_now": env.installed_now,
    }
    if not env.ok or env.python is None:
        return report | {"ok": False, "reason": env.reason}
    sweep = SWEEPS[system] if all_options else SWEEPS[system][:1]
    servers: list[dict[str, Any]] = []
    for options in sweep:
        for model in MODELS_OF_SYSTEM[system]:
            entry = _verify_model(
                system,
                model,
                env.python,
                options,
                reference,
                load_s=load_s,
                concurrency=concurrency,
                lock=lock,
            )
            servers.append({"model": model, "options": options.label} | entry)
    report["servers"] = servers
    report["ok"] = all(entry.get("ok") for entry in servers)
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def _verify_model(
    system: str,
    model: str,
    python: Path,
    options: PeerOptions,
    reference: Reference,
    *,
    load_s: float,
    concurrency: int,
    lock: Path,
) -> dict[str, Any]:
    server = peer_server(system, python, model, options)
    entry: dict[str, Any] = {"server": server.name}
    try:
        before = time.monotonic()
        try:
            server.start(ready_timeout_s=READY_TIMEOUT_S)
        except RuntimeError as exc:
            return entry | {"ok": False, "reason": f"did not start: {str(exc)[-600:]}"}
        entry["ready_s"] = round(time.monotonic() - before, 1)
        names = [name for name in ALL if MODEL_OF_WORKLOAD[name] == model]
        checks = [check_workload(server.url, system, name, reference) for name in names]
        entry["checks"] = [check.as_dict() for check in checks]
        entry["ok"] = all(check.passed for check in checks)
        if entry["ok"] and load_s > 0 and have_wrk():
            entry["load"] = [
                _short_load(server.url, system, name, load_s, concurrency, lock) for name in names
            ]
    finally:
        server.stop()
    return entry


def _short_load(
    url: str, system: str, name: str, load_s: float, concurrency: int, lock: Path
) -> dict[str, Any]:
    if load_s > SHORT_RUN_S and not wait_while_locked(lock):
        return {"workload": name, "skipped": f"{lock} still present"}
    workload = make(name)
    peer_route = route(system, name)
    with tempfile.TemporaryDirectory(prefix="nograd-peer-bodies-") as folder:
        bodies = write_peer_bodies(workload, peer_route.body_format, Path(folder))
        result = run_closed(
            url + peer_route.path,
            bodies,
            system=system,
            workload=name,
            samples_per_request=workload.samples_per_request,
            connections=concurrency,
            duration_s=load_s,
            cpus=None,
        )
    return {
        "workload": name,
        "rps": round(result.rps, 1),
        "p50_ms": round(result.p50_ms, 1),
        "p99_ms": round(result.p99_ms, 1),
        "errors": result.errors,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--load-seconds", type=float, default=5.0, help="0: no load run")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--lock-file", type=Path, default=Path("/tmp/bench.lock"))
    parser.add_argument(
        "--all-options", action="store_true", help="every configuration of each peer's sweep"
    )
    args = parser.parse_args(argv)
    reference = Reference()
    reports = [
        verify_system(
            system,
            reference,
            load_s=args.load_seconds,
            concurrency=args.concurrency,
            lock=args.lock_file,
            all_options=args.all_options,
        )
        for system in args.systems
    ]
    print(json.dumps(reports, indent=2))
    return 0 if all(report["ok"] for report in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
