"""Phase ``fleet``: many models across a fleet of on-demand replicas behind HAProxy (issue 54).

On one machine, ``nograd fleet up`` starts 3 replicas, each ``on_demand`` under a 256 MiB limit,
over 24 ONNX models of 32 MiB; clients ask for the models with Zipf popularity. It measures
model-aware balancing (consistent hashing on the model's name) against ``--balance roundrobin``
on the same settings, in paired rounds (the order alternates; every round starts fresh
fleets): requests answered, cold loads (each replica's ``nograd_model_loads_total``), answers
from another model than the one asked, p50/p99. Then, under the same load, a ``nograd fleet
rolling-restart`` and a ``nograd fleet scale --replicas 4``: every failed request (any status
but 200, 503 included, or a broken connection), and the share of models whose home replica
the scale moved.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import orjson

from bench.common import (
    PYTHON,
    RESULTS,
    ROOT,
    free_port,
    http_get,
    metric,
    percentile,
    scrape_metrics,
)
from bench.residency_models import MIB, ROWS, onnx_repository, remove_generated
from bench.session import Bench
from nograd.fleet.homes import homes as model_homes
from nograd.fleet.replicas import stop_process
from nograd.fleet.state import Fleet, load, state_path

MODELS: Final = 24
WEIGHTS_MIB: Final = 32
REPLICAS: Final = 3
SCALED_REPLICAS: Final = 4
LIMIT_MIB: Final = 256
CLIENTS: Final = 8
ZIPF_EXPONENT: Final = 1.1
"""Popularity of the model of rank ``r`` (from 1): ``1 / r ** ZIPF_EXPONENT``, as a model hub's."""
BALANCES: Final = ("model", "roundrobin")
TARGET_REQUESTS: Final = 2.0
"""Model-aware balancing answers at least this many times the requests of round robin..."""
TARGET_LOADS: Final = 0.25
"""... with at most this share of its cold loads."""
TARGET_MOVED: Final = 0.25
"""A scale from 3 to 4 replicas moves the home of about a quarter of the models at most."""
FLEET_COMMAND: Final = (PYTHON, "-m", "nograd", "fleet")
REQUEST_TIMEOUT_S: Final = 120.0
COMMAND_TIMEOUT_S: Final = 600.0
BODY: Final = {
    "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, ROWS], "data": [0.0] * ROWS}]
}
"""A zero row: each model answers its own index."""


def zipf_popularity(models: int) -> list[float]:
    return [1 / (rank + 1) ** ZIPF_EXPONENT for rank in range(models)]


@dataclass
class Traffic:
    """What the clients saw while they ran: every request is answered, failed or wrong."""

    answers: list[tuple[float, float]] = field(default_factory=list)
    """Each request answered 200 by the model asked: when it finished (seconds from the
    clients' start) and how long it took."""
    failed: Counter[str] = field(default_factory=Counter)
    """Failed requests by kind: the status (``503``...) or the client's exception's name."""
    wrong: list[str] = field(default_factory=list)
    """200 answers from another model than the one asked."""
    models_answered: set[str] = field(default_factory=set)
    seconds: float = 0.0
    """From the clients' start until the last of them stopped."""

    def summary(self, window_s: float | None = None) -> dict[str, Any]:
        """Answers, failures and latency; with ``window_s``, only the requests answered within
        the window's first seconds count as answered (those still running when the clients
        were told to stop do not), so runs of the same window compare."""
        window = self.seconds if window_s is None else window_s
        took = [took for finished, took in self.answers if finished <= window]
        return {
            "answered": len(took),
            "failed": sum(self.failed.values()),
            "failures": dict(self.failed),
            "wrong": len(self.wrong),
            "wrong_examples": self.wrong[:5],
            "models_answered": len(self.models_answered),
            "seconds": window,
            "rps": len(took) / window if window else None,
            "p50_ms": 1000 * statistics.median(took) if took else None,
            "p99_ms": 1000 * percentile(took, 0.99) if took else None,
        }


class Clients:
    """``clients`` threads, each on its own keep-alive connection to ``url``, asking for models
    with Zipf popularity from ``start()`` until ``stop()``; each client first asks once for its
    share of the models, so every model is asked."""

    def __init__(self, url: str, models: int, clients: int = CLIENTS) -> None:
        self.url = url
        self.models = models
        self.traffic = Traffic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(n, clients)) for n in range(clients)
        ]
        self._started = 0.0

    def start(self) -> Clients:
        self._started = time.perf_counter()
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> Traffic:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self.traffic.seconds = time.perf_counter() - self._started
        return self.traffic

    def _client(self, number: int, clients: int) -> None:
        chooser = random.Random(number)
        popularity = zipf_popularity(self.models)
        first = list(range(number, self.models, clients))
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S) as http:
            while not self._stop.is_set():
                index = first.pop() if first else chooser.choices(range(self.models), popularity)[0]
                self._ask(http, index)

    def _ask(self, http: httpx.Client, index: int) -> None:
        name = f"m{index}"
        started = time.perf_counter()
        try:
            answer = http.post(f"/v2/models/{name}/infer", json=BODY)
        except httpx.HTTPError as exc:
            with self._lock:
                self.traffic.failed[type(exc).__name__] += 1
            return
        finished = time.perf_counter()
        with self._lock:
            if answer.status_code != 200:
                self.traffic.failed[str(answer.status_code)] += 1
            elif answer.json()["outputs"][0]["data"] != [float(index)]:
                self.traffic.wrong.append(f"{name}: {answer.text[:200]}")
            else:
                since = finished - self._started
                self.traffic.answers.append((since, finished - started))
                self.traffic.models_answered.add(name)


@contextlib.contextmanager
def clients_running(url: str, models: int) -> Iterator[Clients]:
    clients = Clients(url, models).start()
    try:
        yield clients
    finally:
        clients.stop()


@dataclass
class FleetRun:
    """One fleet started by ``nograd fleet up`` for the phase, driven through its command."""

    repository: Path
    state_dir: Path
    limit_mib: int
    port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The replicas' settings, and nothing else of this process's ``NOGRAD_*``."""
        return {
            **{k: v for k, v in os.environ.items() if not k.startswith("NOGRAD_")},
            "NOGRAD_MODEL_REPOSITORY": str(self.repository),
            "NOGRAD_MODEL_CONTROL": "on_demand",
            "NOGRAD_MEMORY_LIMIT_BYTES": f"{self.limit_mib}MiB",
            # The mapped forms of the run's generated models stay in the run's folder.
            "NOGRAD_ENGINE_CACHE": str(self.repository.parent / "engines"),
            "NOGRAD_LOG_LEVEL": "warning",
        }

    def command(self, *args: str) -> float:
        """``nograd fleet ARGS`` on this fleet; its seconds. Raises with its output if it fails."""
        started = time.monotonic()
        done = subprocess.run(
            [*FLEET_COMMAND, *args, "--port", str(self.port), "--state-dir", str(self.state_dir)],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(f"nograd fleet {' '.join(args)}: {done.stdout}{done.stderr}"[-2000:])
        return time.monotonic() - started

    def state(self) -> Fleet:
        return load(state_path(self.state_dir, self.port))

    def replica_urls(self) -> dict[int, str]:
        return {r.slot: f"http://127.0.0.1:{r.http_port}" for r in self.state().replicas}

    def loads(self) -> float:
        """Cold loads so far, over every replica running now."""
        return sum(
            metric(scrape_metrics(url), "nograd_model_loads_total")
            for url in self.replica_urls().values()
        )

    def placement(self) -> dict[str, dict[str, Any]]:
        """Each replica's resident models and the bytes they hold (``/nograd/placement``), by
        its slot (as a string: the record is JSON)."""
        found = {}
        for slot, url in self.replica_urls().items():
            status, body = http_get(f"{url}/nograd/placement", timeout=10.0)
            if status != 200:
                continue
            document = orjson.loads(body)
            resident = [row for row in document["models"] if row["state"] == "resident"]
            found[str(slot)] = {
                "resident": sorted(row["name"] for row in resident),
                "used_mib": document["memory"]["used_bytes"] / MIB,
                "model_mib": statistics.median(row["bytes"] / MIB for row in resident)
                if resident
                else None,
            }
        return found

    def stop(self) -> None:
        """``nograd fleet down``; if that fails, every process the state names is stopped."""
        path = state_path(self.state_dir, self.port)
        if not path.is_file():
            return
        try:
            self.command("down", "--drain-timeout", "5")
        except (RuntimeError, subprocess.TimeoutExpired):
            fleet = load(path)
            for pid in [fleet.balancer_pid, *(replica.pid for replica in fleet.replicas)]:
                stop_process(pid, 5.0)
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def fleet_up(run: FleetRun, replicas: int, balance: str) -> Iterator[FleetRun]:
    try:
        run.command(
            "up",
            "--replicas",
            str(replicas),
            "--balance",
            balance,
            "--grpc-port",
            str(run.grpc_port),
        )
        yield run
    finally:
        run.stop()


def homes(run: FleetRun, models: int) -> dict[str, int]:
    """Each model's home: the replica slot the balancer sends its metadata call to (its
    ``x-nograd-replica`` answer header), which loads nothing."""
    return model_homes(run.url, [f"m{index}" for index in range(models)])


def moved_share(before: Mapping[str, int], after: Mapping[str, int]) -> float:
    """The share of the models whose home is another replica after than before."""
    return sum(after[name] != slot for name, slot in before.items()) / len(before)


def round_order(round_index: int, rounds: int) -> tuple[str, ...]:
    """The balances in the order round ``round_index`` runs them: alternating round by round,
    and the last round ends on model-aware balancing (its fleet then takes the restart and
    the scale)."""
    last_first = BALANCES[::-1]
    return last_first if (rounds - 1 - round_index) % 2 == 0 else BALANCES


def ratios(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Model-aware against round robin, round by round: requests answered and cold loads; the
    medians over the rounds, and whether they meet the issue's targets."""
    by_round: dict[int, dict[str, Mapping[str, Any]]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["balance"]] = run
    requests, loads, per_answer = [], [], []
    for pair in (by_round[r] for r in sorted(by_round)):
        if set(pair) != set(BALANCES):
            continue
        model, plain = pair["model"], pair["roundrobin"]
        requests.append(_ratio(model["answered"], plain["answered"]))
        loads.append(_ratio(model["loads"], plain["loads"]))
        per_answer.append(_ratio(model.get("loads_per_answer"), plain.get("loads_per_answer")))
    requests_median = _median(requests)
    loads_median = _median(loads)
    return {
        "requests": requests,
        "loads": loads,
        "loads_per_answer": per_answer,
        "requests_median": requests_median,
        "loads_median": loads_median,
        "loads_per_answer_median": _median(per_answer),
        "requests_met": requests_median is not None and requests_median >= TARGET_REQUESTS,
        "loads_met": loads_median is not None and loads_median <= TARGET_LOADS,
    }


def _ratio(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def _median(values: Sequence[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def measure_balance(run: FleetRun, models: int, seconds: float) -> dict[str, Any]:
    """Clients for ``seconds`` on a fresh fleet: what they saw and the loads it took, in all
    and in the second half (once each model's first load is usually behind)."""
    before = run.loads()
    with clients_running(run.url, models) as clients:
        time.sleep(seconds / 2)
        halfway = run.loads()
        time.sleep(seconds / 2)
        loads = run.loads() - before
    summary = clients.traffic.summary(seconds)
    summary["loads"] = loads
    summary["loads_second_half"] = loads - (halfway - before)
    summary["placement"] = run.placement()
    summary["loads_per_answer"] = (
        summary["loads"] / summary["answered"] if summary["answered"] else None
    )
    return summary


def measure_change(run: FleetRun, models: int, *args: str) -> dict[str, Any]:
    """Clients on the fleet while ``nograd fleet ARGS`` runs (and a second after)."""
    with clients_running(run.url, models) as clients:
        time.sleep(1.0)
        took = run.command(*args)
        time.sleep(1.0)
    summary = clients.traffic.summary()
    summary["command_s"] = took
    return summary


def measure_fleet(
    folder: Path,
    *,
    models: int = MODELS,
    weights_mib: int = WEIGHTS_MIB,
    limit_mib: int = LIMIT_MIB,
    seconds: float = 60.0,
    rounds: int = 1,
    step: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The whole phase on a repository of ``models`` ONNX models of ``weights_mib`` written
    under ``folder``: its record. ``step(label)`` is told each step as it starts."""
    say = step or (lambda label: None)
    record: dict[str, Any] = {
        "models": models,
        "weights_mib": weights_mib,
        "replicas": REPLICAS,
        "scaled_replicas": SCALED_REPLICAS,
        "limit_mib": limit_mib,
        "clients": CLIENTS,
        "zipf_exponent": ZIPF_EXPONENT,
        "seconds": seconds,
        "rounds": rounds,
        "runs": [],
    }
    say("fleet: build the models")
    repository = onnx_repository(folder, models, weights_mib)
    for round_index in range(rounds):
        for balance in round_order(round_index, rounds):
            run = FleetRun(repository, folder / "state", limit_mib)
            say(f"fleet: round {round_index + 1}, balance {balance}")
            with fleet_up(run, REPLICAS, balance):
                summary = measure_balance(run, models, seconds)
                record["runs"].append({"round": round_index, "balance": balance, **summary})
                last = round_index == rounds - 1 and balance == "model"
                if last:
                    say("fleet: a rolling restart under load")
                    record["rolling_restart"] = measure_change(run, models, "rolling-restart")
                    say("fleet: a scale from 3 to 4 replicas under load")
                    before = homes(run, models)
                    record["scale"] = measure_change(
                        run, models, "scale", "--replicas", str(SCALED_REPLICAS)
                    )
                    after = homes(run, models)
                    record["scale"]["homes_before"] = before
                    record["scale"]["homes_after"] = after
                    record["scale"]["moved_share"] = moved_share(before, after)
    record["ratios"] = ratios(record["runs"])
    return record


def phase_fleet(bench: Bench) -> None:
    quick = bench.plan.quick
    folder = RESULTS / f"{bench.stamp}-fleet"
    try:
        record = measure_fleet(
            folder,
            models=8 if quick else MODELS,
            weights_mib=8 if quick else WEIGHTS_MIB,
            limit_mib=64 if quick else LIMIT_MIB,
            seconds=bench.plan.fleet_seconds,
            rounds=bench.plan.fleet_rounds,
            step=bench.step,
        )
    finally:
        remove_generated(folder)  # the replicas' logs stay, under state/
    bench.results["fleet"] = record
    found = record["ratios"]
    bench.note(
        f"fleet: model-aware against round robin: {_x(found['requests_median'])} the requests, "
        f"{_x(found['loads_median'])} the loads; rolling restart failed "
        f"{record['rolling_restart']['failed']}, scale failed {record['scale']['failed']} and "
        f"moved {record['scale']['moved_share']:.0%} of the models"
    )


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"
