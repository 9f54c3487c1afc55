"""The processes phase: nograd as one engine process with front processes (``NOGRAD_FRONTS``)
against nograd as workers that each hold every model (``NOGRAD_WORKERS``), both this checkout's
code on the shipped models. Per system: which of its processes map libtorch, the whole process
group's memory (PSS) warm and after the load, the time to ready from a fresh engine cache and
from the same cache again (each system started alone), which processes hold a load's
connections; then, both up together, their answers compared and paired rounds. With ``--base
REV`` a third system joins every step: the workers of revision REV (``base``, the process model
before the engine process, on its own shipped models and engine cache), the baseline the
engine process's targets are stated against."""

from __future__ import annotations

import contextlib
import http.client
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, Server, nograd_server, run_only
from bench.phases.archives import answers_of
from bench.phases.peers import measure_rounds
from bench.phases.revisions import base_checkout, base_server, compare, shipped_models
from bench.process_tree import connections_held, descendants, maps_library, pss_bytes
from bench.session import Bench, _machine_busy_s, _tree_cpu_s

WORKERS = "workers"
ENGINE = "engine"
BASE = "base"
"""The workers of the ``--base`` revision: the process model the engine process replaces."""
SYSTEMS = (WORKERS, ENGINE)
WORKLOADS = ("digits", "minilm-1")
CONNECTION_WORKLOAD = "digits"
READY_TIMEOUT_S = 600.0
"""A cold start of two workers on two shared cores loads and profiles every model twice."""
LOG_ENV = {"NOGRAD_LOG_LEVEL": "info", "NOGRAD_LOG_FORMAT": "text"}
"""The supervisor's start-up log names each process's pid and says when it was ready."""
PROCESS = r"((?:engine|front|worker)(?: \d+)?)"
"""How the supervisor's log names a process: ``engine``, ``front 1``, ``worker 0``."""
STARTED = re.compile(PROCESS + r" started \(pid (\d+)\)")
READY = re.compile(PROCESS + r" ready after ([\d.]+)s")
START_UP = re.compile(r"started \(pid|ready after|listening on")
LIBTORCH = "libtorch"
SUPERVISOR = "supervisor"


def system_server(bench: Bench, system: str, cache: Path, base: Path | None = None) -> Server:
    """nograd from this checkout on the shipped models, as ``workers`` (``NOGRAD_WORKERS``) or as
    one ``engine`` with fronts (``NOGRAD_FRONTS``, ``NOGRAD_WORKERS`` unset), or the ``base``
    revision's workers from its checkout ``base`` on its own shipped models; on the engine cache
    ``cache``."""
    env = {**LOG_ENV, "NOGRAD_ENGINE_CACHE": str(cache)}
    if system in (WORKERS, BASE):
        env["NOGRAD_WORKERS"] = bench.plan.process_workers
    else:
        env["NOGRAD_FRONTS"] = bench.plan.process_fronts
    if system == BASE:
        assert base is not None
        return base_server(
            base, shipped_models(base, base.parent / "repository"), bench.plan.server_cpus, env
        )
    server = nograd_server(ROOT / "models", bench.plan.server_cpus, env)
    if system == ENGINE:
        server.env = {k: v for k, v in server.env.items() if k != "NOGRAD_WORKERS"}
    server.name = system
    return server


@contextlib.contextmanager
def maybe_base(revision: str | None, record: dict[str, Any]) -> Iterator[Path | None]:
    """The ``--base`` revision's worktree (``base_checkout``), or None without one."""
    if revision is None:
        yield None
        return
    record["base"] = revision
    with base_checkout(revision, record, "nograd-processes-base-") as checkout:
        yield checkout


def timed_start(server: Server) -> float:
    """Seconds from starting the server's process to its first ready answer (200 from
    ``/v2/health/ready``); a server that does not get there is stopped."""
    started = time.monotonic()
    try:
        server.start(ready_timeout_s=READY_TIMEOUT_S)
    except BaseException:
        server.stop()
        raise
    return time.monotonic() - started


def roles(log: str, supervisor: int) -> dict[int, str]:
    """pid -> what the supervisor's log calls it (``engine``, ``front 1``, ``worker 0``; a pid
    started twice keeps its latest name), the supervisor's own pid included."""
    found = {supervisor: SUPERVISOR}
    for name, pid in STARTED.findall(log):
        found[int(pid)] = name
    return found


def role_of(pid: int, names: dict[int, str]) -> str:
    """A process's name; a child the supervisor's log does not name (a helper process that
    ``multiprocessing`` starts) goes by its pid."""
    return names.get(pid, f"pid {pid}")


def ready_after(log: str) -> dict[str, float]:
    """Each process's own start-up time as the supervisor logged it (``... ready after X s``)."""
    return {name: float(seconds) for name, seconds in READY.findall(log)}


def _log(server: Server) -> str:
    if server.log_path is None or not server.log_path.exists():
        return ""
    return server.log_path.read_text(errors="replace")


def model_table(log: str) -> dict[str, dict[str, str]]:
    """Per model, the engine it serves on and its batch limit, from the table a process logs
    once its models are loaded (the last table where several processes log one)."""
    found: dict[str, dict[str, str]] = {}
    for line in log.splitlines():
        fields = line.split()
        # model, version, state, format, engine, device, limit, unit, ...
        if len(fields) >= 8 and fields[1].isdigit() and fields[2] == "ready":
            found[fields[0]] = {"engine": fields[4], "limit": f"{fields[6]} {fields[7]}"}
    return found


def census(server: Server) -> dict[str, Any]:
    """The server's processes (the supervisor and everything below it), which map libtorch,
    and the engine each model serves on."""
    log = _log(server)
    names = roles(log, server.pid)
    processes = [
        {"pid": pid, "role": role_of(pid, names), "libtorch": maps_library(pid, LIBTORCH)}
        for pid in descendants(server.pid)
    ]
    return {
        "processes": processes,
        "libtorch": sum(1 for p in processes if p["libtorch"]),
        "models": model_table(log),
    }


def group_memory(server: Server) -> dict[str, Any]:
    """The whole process group's PSS, and each process's."""
    names = roles(_log(server), server.pid)
    by_process = {role_of(pid, names): pss_bytes(pid) for pid in descendants(server.pid)}
    return {"pss_bytes": sum(by_process.values()), "by_process": by_process}


def connections(bench: Bench, server: Server, everyone: list[Server]) -> dict[str, Any]:
    """Open ``bench.plan.concurrency`` keep-alive connections to ``server`` (the others paused),
    one request on each, and count, while they are all open, the ones each process holds."""
    run_only(server, everyone)
    wl = bench.workload(CONNECTION_WORKLOAD)
    count = bench.plan.concurrency
    opened: list[http.client.HTTPConnection] = []
    answered = 0
    try:
        for index in range(count):
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            opened.append(connection)
            connection.request(
                wl.method,
                wl.path,
                body=wl.bodies[index % len(wl.bodies)],
                headers={"content-type": wl.content_type},
            )
            response = connection.getresponse()
            response.read()
            answered += response.status == 200
        names = roles(_log(server), server.pid)
        held = connections_held(descendants(server.pid), server.port)
    finally:
        for connection in opened:
            connection.close()
        for other in everyone:
            other.resume()
    by_process = {role_of(pid, names): n for pid, n in held.items()}
    return {
        "connections": count,
        "answered": answered,
        "by_process": by_process,
        "holding": sum(1 for n in by_process.values() if n > 0),
    }


def _start_ups(
    bench: Bench,
    folder: Path,
    starts: list[dict[str, Any]],
    systems: tuple[str, ...],
    base: Path | None,
) -> dict[str, Path]:
    """Each system started alone from a fresh engine cache (cold), stopped, then started again on
    the same cache (warm), ``process_starts`` times, the order of the systems reversed each
    time; every start after a wait for a quiet machine. Each start is added to ``starts`` as it
    ends; returns each system's last cache."""
    caches: dict[str, Path] = {}
    for index in range(bench.plan.process_starts):
        order = systems if index % 2 == 0 else systems[::-1]
        for system in order:
            caches[system] = folder / f"engines-{system}-{index + 1}"
            for kind in ("cold", "warm"):
                server = system_server(bench, system, caches[system], base)
                bench.quiet()
                bench.step(f"processes: start {system} ({kind})")
                busy = _machine_busy_s()
                try:
                    seconds = timed_start(server)
                    own = _tree_cpu_s(server.pid)
                    foreign = max(0.0, _machine_busy_s() - busy - own) / seconds
                    log = _log(server)
                finally:
                    server.stop()
                starts.append(
                    {
                        "round": index + 1,
                        "system": system,
                        "kind": kind,
                        "seconds": seconds,
                        "foreign_cpu_cores": foreign,
                        "ready_after": ready_after(log),
                        "log": [line[-200:] for line in log.splitlines() if START_UP.search(line)],
                    }
                )
    return caches


def phase_processes(bench: Bench) -> None:
    plan = bench.plan
    record: dict[str, Any] = {
        "workers": plan.process_workers,
        "fronts": plan.process_fronts,
        "workloads": list(WORKLOADS),
        "start_ups": [],
        "runs": [],
    }
    bench.results["processes"] = record
    folder = RESULTS / f"{bench.stamp}-processes"
    with maybe_base(plan.base_revision, record) as base:
        _measure(bench, record, folder, base)


def _measure(bench: Bench, record: dict[str, Any], folder: Path, base: Path | None) -> None:
    plan = bench.plan
    names = SYSTEMS if base is None else (*SYSTEMS, BASE)
    record["systems"] = list(names)
    caches = _start_ups(bench, folder, record["start_ups"], names, base)
    # One engine cache, the one the workers' starts wrote: both systems serve each model on the
    # same engines, so the rounds and the memory compare the process models, not two choices
    # each start made on a machine that other processes disturbed. The base revision keeps its
    # own (its cache may be another format).
    record["shared_cache"] = WORKERS
    with contextlib.ExitStack() as stack:
        systems: list[tuple[str, Server]] = []
        for system in names:
            cache = caches[BASE if system == BASE else WORKERS]
            server = system_server(bench, system, cache, base)
            bench.step(f"processes: start {system} beside the others")
            timed_start(server)
            stack.callback(server.stop)
            systems.append((system, server))
        everyone = [server for _, server in systems]
        servers = dict(systems)
        record["processes"] = {name: census(server) for name, server in systems}
        checks: dict[str, Any] = {}
        for name in WORKLOADS:
            wl = bench.workload(name)
            bench.bodies.setdefault(name, wl.write_bodies(RESULTS / "bodies"))
            bench.step(f"processes: compare answers ({name})")
            engine = answers_of(servers[ENGINE], wl)
            checks[name] = compare(engine, answers_of(servers[WORKERS], wl), (ENGINE, WORKERS))
            if BASE in servers:
                checks[f"{name} (base)"] = compare(
                    engine, answers_of(servers[BASE], wl), (ENGINE, BASE)
                )
        record["check"] = checks
        record["memory_warm"] = {name: group_memory(server) for name, server in systems}
        record["connections"] = {}
        for name, server in systems:
            bench.step(f"processes: {plan.concurrency} connections to {name}")
            record["connections"][name] = connections(bench, server, everyone)
        differ = {n: c for n, c in checks.items() if c["same"] != c["requests"]}
        if any(n in differ for n in WORKLOADS):
            record["refused"] = f"answers differ between the systems: {differ}"[:600]
            bench.note(record["refused"])
            return
        if differ:
            # The base answers otherwise: no rounds against it, the others still measured.
            record["base_refused"] = f"the base revision's answers differ: {differ}"[:600]
            bench.note(record["base_refused"])
            systems = [(name, server) for name, server in systems if name != BASE]
        lineup = {name: systems for name in WORKLOADS}
        concurrencies = sorted({1, plan.concurrency}, reverse=True)
        record["runs"] = measure_rounds(bench, lineup, everyone, concurrencies, "processes")
        record["memory_after_rounds"] = {name: group_memory(server) for name, server in systems}
