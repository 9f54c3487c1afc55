"""``nograd fleet up|down|rolling-restart|scale``: a fleet of nograd replicas behind HAProxy on
one machine. Each command reads the fleet's state file (``nograd.fleet.state``), acts through
HAProxy's Runtime API and the replicas' processes, and returns once the fleet is ready again.

With model-aware balancing, ``up`` then evens the models' homes through the replicas' weights
(``nograd.fleet.homes``); a scale keeps the others' weights and steps only a new replica's
until it is the home of its share, so that only the models it takes (or a removed one leaves)
move; ``homes`` shows the homes, ``homes --even`` evens them again.

A replica leaves HAProxy's ring before it stops: its slot drains (no new request goes to it,
those it runs finish), the command waits until HAProxy holds no request on it, and only then
the replica gets SIGTERM (and drains what reached it directly). A new or restarted replica
joins only once its own readiness says so."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

import httpx

from nograd.fleet.balancer import (
    BALANCES,
    CONFIG,
    BalancerError,
    RuntimeApi,
    balancer_env,
    start_balancer,
)
from nograd.fleet.homes import WEIGHT, even_homes, homes, model_names, settle_new, spread
from nograd.fleet.replicas import (
    HOST,
    ReplicaError,
    free_ports,
    log_tail,
    replica_settings,
    start_replica,
    stop_process,
    wait_ready,
)
from nograd.fleet.state import Fleet, Replica, alive, load, save, state_path, state_root

DEFAULT_SLOTS: Final = 16
EVEN_WITHIN: Final = 1
"""``up`` (and ``homes --even``) step the weights until the replicas' numbers of homes differ
by one at most."""


def fleet_command(argv: list[str]) -> int:
    options = _parser().parse_args(argv)
    root = state_root(options.state_dir)
    try:
        if options.action == "up":
            return up(options, root)
        path = state_path(root, options.port)
        if not path.is_file():
            print(f"nograd fleet: no fleet on port {options.port} (no {path})", file=sys.stderr)
            return 1
        fleet = load(path)
        if options.action == "down":
            down(fleet, options.stop_timeout, options.drain_timeout)
            path.unlink()
        elif options.action == "rolling-restart":
            rolling_restart(fleet, path, options)
        elif options.action == "homes":
            show_homes(fleet, options.even)
        else:
            scale(fleet, path, options)
    except (BalancerError, ReplicaError, OSError, httpx.HTTPError) as exc:
        print(f"nograd fleet {options.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nograd fleet",
        description="Several nograd replicas behind HAProxy on this machine, each model's "
        "requests sent to the replica that holds it (docs/fleet.md). Replica settings come "
        "from the environment (NOGRAD_*), as for `nograd`.",
    )
    actions = parser.add_subparsers(dest="action", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--port", type=int, required=True, help="the balancer's HTTP port")
    common.add_argument("--state-dir", type=Path, help="where fleets are recorded")
    common.add_argument(
        "--ready-timeout", type=float, default=300.0, help="seconds a replica may take to start"
    )
    common.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for a draining replica's requests through the balancer",
    )
    common.add_argument(
        "--stop-timeout",
        type=float,
        default=60.0,
        help="seconds a replica may take to stop after SIGTERM before it is killed",
    )
    up_parser = actions.add_parser("up", parents=[common], help="start replicas and HAProxy")
    up_parser.add_argument("--replicas", type=int, required=True)
    up_parser.add_argument("--grpc-port", type=int, help="the balancer's gRPC port (port + 1)")
    up_parser.add_argument("--host", default=HOST, help="the balancer's address")
    up_parser.add_argument("--balance", choices=BALANCES, default="model")
    up_parser.add_argument("--slots", type=int, default=DEFAULT_SLOTS, help="most replicas")
    up_parser.add_argument("--config", type=Path, default=CONFIG, help="HAProxy configuration")
    actions.add_parser("down", parents=[common], help="drain and stop the fleet")
    actions.add_parser(
        "rolling-restart", parents=[common], help="restart the replicas one at a time"
    )
    scale_parser = actions.add_parser("scale", parents=[common], help="add or remove replicas")
    scale_parser.add_argument("--replicas", type=int, required=True)
    homes_parser = actions.add_parser(
        "homes", parents=[common], help="each model's home replica and the replicas' weights"
    )
    homes_parser.add_argument(
        "--even", action="store_true", help="even the homes through the weights first"
    )
    return parser


def up(options: argparse.Namespace, root: Path) -> int:
    path = state_path(root, options.port)
    if path.is_file():
        known = load(path)
        if alive(known.balancer_pid):
            print(f"nograd fleet up: a fleet runs on port {options.port} ({path})", file=sys.stderr)
            return 1
        down(known, options.stop_timeout, 0.0)
    if not 1 <= options.replicas <= options.slots:
        print(f"nograd fleet up: --replicas must be 1..{options.slots}", file=sys.stderr)
        return 1
    folder = root / str(options.port)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    socket_path = folder / "haproxy.sock"
    grpc_port = options.grpc_port or options.port + 1
    env = balancer_env(
        options.host, options.port, grpc_port, socket_path, options.balance, options.slots
    )
    balancer = start_balancer(options.config, {**os.environ, **env}, folder / "haproxy.log")
    fleet = Fleet(
        port=options.port,
        grpc_port=grpc_port,
        host=options.host,
        balance=options.balance,
        slots=options.slots,
        balancer_pid=balancer.pid,
        socket=str(socket_path),
        folder=str(folder),
        replica_env=replica_settings(os.environ),
    )
    save(fleet, path)
    try:
        add_replicas(fleet, path, options.replicas, options.ready_timeout)
        found = _even(fleet)
    except (BalancerError, ReplicaError, httpx.HTTPError):
        down(fleet, options.stop_timeout, 0.0)
        path.unlink(missing_ok=True)
        raise
    print(
        f"nograd fleet: {options.replicas} replicas behind http://{options.host}:{options.port} "
        f"(gRPC {options.host}:{grpc_port}), balance {options.balance}; state in {path}"
    )
    _print_spread(fleet, found)
    return 0


def _url(fleet: Fleet) -> str:
    host = "127.0.0.1" if fleet.host in ("0.0.0.0", "") else fleet.host
    return f"http://{host}:{fleet.port}"


def _even(fleet: Fleet) -> dict[str, int]:
    """Under model-aware balancing, the replicas' weights stepped until their numbers of homes
    differ by ``EVEN_WITHIN`` at most (``nograd.fleet.homes``); the homes then."""
    if fleet.balance != "model" or not fleet.replicas:
        return {}
    models = model_names(_url(fleet))
    slots = [replica.slot for replica in fleet.replicas]
    return even_homes(RuntimeApi(Path(fleet.socket)), _url(fleet), models, slots, EVEN_WITHIN)


def _print_spread(fleet: Fleet, found: Mapping[str, int]) -> None:
    if found:
        counts = spread(found, [replica.slot for replica in fleet.replicas])
        print("homes: " + ", ".join(f"replica{slot} {n}" for slot, n in sorted(counts.items())))


def show_homes(fleet: Fleet, even: bool) -> None:
    """Each model's home replica (where the balancer sends it now) and each replica's weight;
    with ``even``, after evening them."""
    found = _even(fleet) if even else homes(_url(fleet), model_names(_url(fleet)))
    api = RuntimeApi(Path(fleet.socket))
    counts = spread(found, [replica.slot for replica in fleet.replicas])
    for replica in fleet.replicas:
        print(
            f"replica{replica.slot} weight {api.weight(replica.slot)} homes "
            f"{counts[replica.slot]} port {replica.http_port}"
        )
    for name, slot in sorted(found.items()):
        print(f"{name} replica{slot}")


def add_replicas(fleet: Fleet, path: Path, count: int, ready_timeout_s: float) -> list[int]:
    """Start ``count`` replicas in the lowest free slots together, then let each into the
    ring once it is ready, at the mean weight of those already there (``WEIGHT`` in a fleet
    starting); their slots."""
    api = RuntimeApi(Path(fleet.socket))
    present = [api.weight(replica.slot) for replica in fleet.replicas]
    weight = round(sum(present) / len(present)) if present else WEIGHT
    ports = free_ports(2 * count)
    started = []
    for index, slot in enumerate(fleet.free_slots()[:count]):
        http_port, grpc_port = ports[2 * index], ports[2 * index + 1]
        replica = start_replica(slot, http_port, grpc_port, fleet.replica_env, Path(fleet.folder))
        fleet.replicas.append(replica)
        started.append(replica)
    fleet.replicas.sort(key=lambda replica: replica.slot)
    save(fleet, path)
    for replica in started:
        api.set_weight(replica.slot, weight)
        _join(api, replica, ready_timeout_s)
    return [replica.slot for replica in started]


def _join(api: RuntimeApi, replica: Replica, ready_timeout_s: float) -> None:
    try:
        wait_ready(replica, ready_timeout_s)
    except ReplicaError as exc:
        raise ReplicaError(f"{exc}\n{log_tail(replica)}") from None
    api.place(replica.slot, replica.http_port, replica.grpc_port)
    api.set_state(replica.slot, "ready")
    api.wait_up(replica.slot, ready_timeout_s)


def _leave(
    api: RuntimeApi, replica: Replica, drain_timeout_s: float, stop_timeout_s: float
) -> None:
    """Drain ``replica``'s slot, wait for the requests HAProxy holds on it, stop it."""
    api.set_state(replica.slot, "drain")
    api.wait_idle(replica.slot, drain_timeout_s)
    stop_process(replica.pid, stop_timeout_s)
    api.set_state(replica.slot, "maint")


def rolling_restart(fleet: Fleet, path: Path, options: argparse.Namespace) -> None:
    """One replica at a time: out of the ring, stopped, started on the same ports, ready,
    back in the ring; the next only once HAProxy sees this one up."""
    api = RuntimeApi(Path(fleet.socket))
    for index, replica in enumerate(list(fleet.replicas)):
        _leave(api, replica, options.drain_timeout, options.stop_timeout)
        fresh = start_replica(
            replica.slot,
            replica.http_port,
            replica.grpc_port,
            fleet.replica_env,
            Path(fleet.folder),
        )
        fleet.replicas[index] = fresh
        save(fleet, path)
        _join(api, fresh, options.ready_timeout)


def scale(fleet: Fleet, path: Path, options: argparse.Namespace) -> None:
    """To ``--replicas``: new ones join once ready; the highest slots leave, drained first."""
    wanted = options.replicas
    if not 1 <= wanted <= fleet.slots:
        raise ReplicaError(f"--replicas must be 1..{fleet.slots} (the fleet's slots)")
    if wanted > len(fleet.replicas):
        new = add_replicas(fleet, path, wanted - len(fleet.replicas), options.ready_timeout)
        if fleet.balance == "model":
            slots = [replica.slot for replica in fleet.replicas]
            url = _url(fleet)
            api = RuntimeApi(Path(fleet.socket))
            _print_spread(fleet, settle_new(api, url, model_names(url), slots, new))
        return
    api = RuntimeApi(Path(fleet.socket))
    for replica in sorted(fleet.replicas, key=lambda r: r.slot)[wanted:]:
        _leave(api, replica, options.drain_timeout, options.stop_timeout)
        fleet.replicas.remove(replica)
        save(fleet, path)


def down(fleet: Fleet, stop_timeout_s: float, drain_timeout_s: float) -> None:
    """Drain every slot, wait for the balancer's requests (up to ``drain_timeout_s``), stop
    the replicas together, then the balancer."""
    if alive(fleet.balancer_pid):
        api = RuntimeApi(Path(fleet.socket))
        try:
            for replica in fleet.replicas:
                api.set_state(replica.slot, "drain")
            for replica in fleet.replicas:
                api.wait_idle(replica.slot, drain_timeout_s)
        except (BalancerError, OSError):
            pass  # a balancer that no longer answers holds no request to wait for
    with ThreadPoolExecutor(max(1, len(fleet.replicas))) as pool:
        list(pool.map(lambda r: stop_process(r.pid, stop_timeout_s), fleet.replicas))
    stop_process(fleet.balancer_pid, stop_timeout_s)
