"""``make bench``: nograd against the servers users would pick instead, side by side, in one run.

Phases (each server is started, measured and stopped in turn, except in the paired rounds; every
process is stopped in a ``finally``):

1. raw model: the same forward in a tight loop, no HTTP, per batch size (``bench.raw``);
2. nograd (``nograd`` command, ``NOGRAD_MODEL_REPOSITORY=models``): closed loop at concurrency
   32, 1 and 8, open loop at fixed arrival rates, py-spy under load;
3. the HTTP ceiling (digits), plain FastAPI, LitServe (a max_batch_size × batch_timeout sweep
   at concurrency 32, then its best configuration at the other loads);
4. nograd with batching off (a temporary model repository whose configs cap batches at 1), with
   one torch thread fewer, and as two worker processes (``NOGRAD_WORKERS=2``; every nograd
   server sets the count, the default ``auto`` picking per machine);
5. paired rounds: nograd (one process and two workers), LitServe's best configuration, the HTTP
   ceiling (and, as context, the same app in two processes) and (for minilm) the raw forward,
   all started once and measured in turn (the others paused), round after round, order reversed
   each round, so each round's ratios compare systems at the same machine speed;
6. speed levers (``bench.levers``), issue 3's memory benchmark (``bench.memory_bench``) and
   torch.profiler on nograd's batch path (``bench.profile_nograd``).

Results: ``bench/results/<timestamp>.json``, ``.png`` (latency vs throughput) and ``.md`` (the
tables BENCHMARKS.md quotes). ``--quick`` is a ~5-minute smoke run of the same kinds of
measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench import loadgen, workloads
from bench.common import PYTHON, RESULTS, ROOT, Server, machine, metric, nograd_server
from bench.common import scrape_metrics as scrape
from bench.loadgen import LoadResult

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is in the bench extra
    tqdm = None

LITSERVE_GRID = ((16, 0.005), (32, 0.005), (64, 0.005), (16, 0.01), (32, 0.01), (64, 0.01))
LITSERVE_QUICK = ((32, 0.005),)
ALL_PHASES = (
    "raw",
    "nograd",
    "ceiling",
    "fastapi",
    "litserve",
    "litserve_packed",
    "batching_off",
    "threads",
    "workers",
    "paired",
    "levers",
    "memory",
    "torch_profile",
)
QUIET_CORES = 0.3
"""Other processes' CPU (in cores) above which a run counts as disturbed."""
MODEL_OF = {"digits": "digits", "minilm-1": "minilm", "minilm-8": "minilm"}
WORKERS_2 = {"NOGRAD_WORKERS": "2"}
PAIRED_RAW_BATCHES = "16,32,64"
"""The paired rounds time the raw minilm forward at these batch sizes only, to keep a round short:
timed in interleaved rounds its best lay at 32-64 rows (transformers' forward) and was flat from
32 rows up (the packed one) on the AMD EPYC, and at 32-64 rows on the Xeon."""
PAIRED_ROUNDS = 3
"""Rounds of the paired phase: the median of three per-round ratios ignores one disturbed round."""


@dataclass
class Plan:
    quick: bool
    concurrency: int
    duration_s: float  # the headline closed-loop runs
    short_s: float  # other concurrencies and open-loop runs
    sweep_s: float  # LitServe configuration sweep
    warmup_s: float
    sweep_concurrencies: tuple[int, ...]
    open_fractions: tuple[float, ...]
    litserve_grid: tuple[tuple[int, float], ...]
    workloads: tuple[str, ...]
    server_cpus: str | None
    generator_cpus: str | None
    levers: bool
    compile: bool
    memory: bool
    profile: bool
    paired_rounds: int  # interleaved rounds of the paired phase
    attempts: int  # per measured run, while other processes disturb it
    quiet_wait_s: float  # per attempt, waiting for a quiet machine
    quiet_budget_s: float  # in all

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Plan:
        split = args.pin == "split"
        quick = bool(args.quick)
        return cls(
            quick=quick,
            concurrency=args.concurrency,
            duration_s=args.duration or (3.0 if quick else 10.0),
            short_s=3.0 if quick else 6.0,
            sweep_s=3.0 if quick else 5.0,
            warmup_s=1.0 if quick else 2.0,
            sweep_concurrencies=(1,) if quick else (1, 8),
            open_fractions=(0.7,) if quick else (0.5, 0.8),
            litserve_grid=LITSERVE_QUICK if quick else LITSERVE_GRID,
            workloads=tuple(args.workloads.split(",")),
            server_cpus="0" if split else None,
            generator_cpus="1" if split else None,
            levers=not args.skip_levers,
            compile=not args.skip_compile and not quick,
            memory=not args.skip_memory,
            profile=not args.skip_profile,
            paired_rounds=args.paired_rounds or (2 if quick else PAIRED_ROUNDS),
            attempts=args.attempts if args.attempts is not None else (1 if quick else 3),
            quiet_wait_s=args.quiet_wait,
            quiet_budget_s=args.quiet_budget,
        )


@dataclass
class Bench:
    plan: Plan
    stamp: str
    bodies: dict[str, Path] = field(default_factory=dict)
    runs: list[LoadResult] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    progress: Any = None
    noisy_retries: int = 0
    quiet_spent_s: float = 0.0

    # ----------------------------------------------------------------------------- helpers
    def step(self, label: str) -> None:
        if self.progress is not None:
            self.progress.set_description_str(label[:60])
            self.progress.update(1)
        else:
            print(f"[bench] {label}", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        message = f"[bench] {text}"
        if self.progress is not None:
            self.progress.write(message)
        else:
            print(message, file=sys.stderr, flush=True)

    def workload(self, name: str) -> workloads.Workload:
        return workloads.make(name)

    def load(self, server: Server, system: str, name: str, **kwargs: Any) -> LoadResult | None:
        """``measure``, repeated while other processes disturbed it; failures are recorded.

        Another process busy on one of the two cores can slow a forward with two torch threads
        ten-fold (a parallel region waits for its descheduled thread), so a run during which
        other processes used more than ``QUIET_CORES`` is repeated (up to the plan's attempts,
        each after waiting for a quiet machine) and the least disturbed attempt is kept. Every
        run records the foreign CPU it saw.
        """
        record = bool(kwargs.pop("record", True))
        # keep=False: retried like a recorded run, but returned only (the paired phase keeps its
        # runs apart, so the per-phase tables and their verdicts are unchanged).
        keep = bool(kwargs.pop("keep", record))
        attempts = self.plan.attempts if record else 1
        best: LoadResult | None = None
        for attempt in range(1, attempts + 1):
            if attempt > 1 or (record and self.plan.attempts > 1):
                self.quiet()
            try:
                result = self.measure(server, system, name, **kwargs)
            except Exception as exc:
                self.results.setdefault("run_errors", []).append(
                    {"system": system, "workload": name, **{k: str(v) for k, v in kwargs.items()}}
                    | {"error": f"{type(exc).__name__}: {exc}"[:500]}
                )
                self.note(f"{system} {name} {kwargs}: {type(exc).__name__}: {exc}"[:300])
                return best
            result.extra["attempt"] = attempt
            foreign = float(result.extra.get("foreign_cpu_cores", 0.0))
            if best is None or foreign < float(best.extra.get("foreign_cpu_cores", 0.0)):
                best = result
            if foreign <= QUIET_CORES:
                break
            self.noisy_retries += 1
        assert best is not None
        best.extra["attempts"] = attempt
        if keep:
            self.runs.append(best)
        return best

    def quiet(self) -> None:
        """Wait (bounded) for other processes to go quiet; gives up once the budget is spent."""
        if self.plan.quiet_wait_s <= 0 or self.quiet_spent_s >= self.plan.quiet_budget_s:
            return
        started = time.monotonic()
        wait_quiet(min(self.plan.quiet_wait_s, self.plan.quiet_budget_s - self.quiet_spent_s))
        self.quiet_spent_s += time.monotonic() - started

    def started(self, server: Server) -> None:
        """Record which code a nograd server runs (the work tree may change during a run)."""
        from bench.common import code_hash

        self.results.setdefault("code", []).append(
            {"server": server.name, "port": server.port, "code_hash": code_hash()}
        )

    def measure(
        self,
        server: Server,
        system: str,
        name: str,
        *,
        concurrency: int | None = None,
        rate: float | None = None,
        duration_s: float,
        nograd_metrics: bool = False,
    ) -> LoadResult:
        """One measured run against ``server``: closed loop (wrk) or open loop (rate)."""
        wl = self.workload(name)
        url = server.url + wl.path
        # The concurrency-1 target's yardstick, measured beside the load (before and after it):
        # the forward's speed moves with the machine's between a run's phases.
        paired = system.startswith("nograd") and name == "minilm-1" and concurrency == 1
        raw_before = self.raw_batch1() if paired else None
        cpu = CpuWatch(server.pid)
        before = scrape(server.url) if nograd_metrics else {}
        if rate is None:
            result = loadgen.run_closed(
                url,
                self.bodies[name],
                system=system,
                workload=name,
                samples_per_request=wl.samples_per_request,
                connections=concurrency or self.plan.concurrency,
                duration_s=duration_s,
                cpus=self.plan.generator_cpus,
            )
        else:
            result = loadgen.run_open(
                url,
                self.bodies[name],
                system=system,
                workload=name,
                samples_per_request=wl.samples_per_request,
                rate=rate,
                duration_s=duration_s,
                cpus=self.plan.generator_cpus,
            )
        result.extra.update(cpu.finish(result))
        if raw_before is not None:
            raw_after = self.raw_batch1()
            result.extra["raw_batch1_p50_ms"] = [raw_before, raw_after]
        if system.startswith("nograd"):
            from bench.common import code_hash

            result.extra["code_hash"] = code_hash()
        if nograd_metrics:
            after = scrape(server.url)
            model = MODEL_OF[name]
            count = metric(after, "nograd_batch_size_count", model=model) - metric(
                before, "nograd_batch_size_count", model=model
            )
            rows = metric(after, "nograd_batch_size_sum", model=model) - metric(
                before, "nograd_batch_size_sum", model=model
            )
            result.extra["batches"] = count
            result.extra["mean_batch_size"] = rows / count if count else 0.0
            # Server-side means (ms) from nograd's own histograms: where a request's time went.
            for key, name in (
                ("server_request_ms", "nograd_request_duration_seconds"),
                ("server_queue_ms", "nograd_queue_duration_seconds"),
                ("server_batch_ms", "nograd_batch_duration_seconds"),
            ):
                n = metric(after, f"{name}_count", model=model) - metric(
                    before, f"{name}_count", model=model
                )
                total = metric(after, f"{name}_sum", model=model) - metric(
                    before, f"{name}_sum", model=model
                )
                result.extra[key] = 1e3 * total / n if n else None
        return result

    def warm(self, server: Server, name: str) -> None:
        self.load(server, "warmup", name, duration_s=self.plan.warmup_s, record=False)

    def headline(
        self, server: Server, system: str, name: str, label: str, **kwargs: Any
    ) -> LoadResult | None:
        """A warm-up, then one run at the plan's concurrency and headline duration."""
        self.warm(server, name)
        self.step(label)
        return self.load(server, system, name, duration_s=self.plan.duration_s, **kwargs)

    def measure_system(
        self, server: Server, system: str, name: str, *, nograd_metrics: bool = False
    ) -> LoadResult | None:
        """Headline run at the plan's concurrency, then the others, then the open loop."""
        label = f"{system} {name} c={self.plan.concurrency}"
        head = self.headline(server, system, name, label, nograd_metrics=nograd_metrics)
        for c in self.plan.sweep_concurrencies:
            self.step(f"{system} {name} c={c}")
            self.load(
                server,
                system,
                name,
                concurrency=c,
                duration_s=self.plan.short_s,
                nograd_metrics=nograd_metrics,
            )
        for rate in self.open_rates(name):
            self.step(f"{system} {name} open {rate:.0f}/s")
            self.load(
                server,
                system,
                name,
                rate=rate,
                duration_s=self.plan.short_s,
                nograd_metrics=nograd_metrics,
            )
        return head

    def open_rates(self, name: str) -> list[float]:
        """Fractions of nograd's closed-loop throughput: the same rates for every system."""
        head = next(
            (
                r
                for r in self.runs
                if r.system == "nograd"
                and r.workload == name
                and r.concurrency == self.plan.concurrency
            ),
            None,
        )
        if head is None or head.rps <= 0:
            return []
        return [max(1.0, round(head.rps * f, 1)) for f in self.plan.open_fractions]

    # ----------------------------------------------------------------------------- phases
    def phase_raw(self) -> None:
        """The raw limit, retried like the load runs when other processes disturbed it."""
        # Full: three interleaved rounds of 0.5 s per batch size (bench.raw keeps each size's
        # best round); quick: one round.
        seconds, rounds = ("0.3", "1") if self.plan.quick else ("0.5", "3")
        best: dict[str, Any] | None = None
        for attempt in range(1, self.plan.attempts + 1):
            self.step(f"raw model (no HTTP), attempt {attempt}")
            if self.plan.attempts > 1:
                self.quiet()
            result, foreign = self.run_raw(["--seconds", seconds, "--rounds", rounds], 600)
            result["foreign_cpu_cores"] = foreign
            result["attempt"] = attempt
            if best is None or foreign < best["foreign_cpu_cores"]:
                best = result
            if foreign <= QUIET_CORES:
                break
            self.noisy_retries += 1
        self.results["raw"] = best

    def phase_nograd(self) -> None:
        server = nograd_server(ROOT / "models", self.plan.server_cpus)
        self.step("start nograd")
        with server:
            for name in self.plan.workloads:
                self.measure_system(server, "nograd", name, nograd_metrics=True)
            if self.plan.profile:
                self.results["pyspy"] = {}
                for name in ("digits", "minilm-1"):
                    if name in self.plan.workloads:
                        self.step(f"py-spy nograd {name}")
                        self.results["pyspy"][name] = self.pyspy(server, name)

    def phase_ceiling(self) -> None:
        if "digits" not in self.plan.workloads:
            return
        server = self.ceiling_server()
        self.step("start HTTP ceiling")
        with server:
            self.measure_system(server, "http-ceiling", "digits")

    def phase_fastapi(self) -> None:
        for model in ("digits", "minilm"):
            names = [n for n in self.plan.workloads if MODEL_OF[n] == model]
            if not names:
                continue
            server = Server(
                f"fastapi-{model}",
                [PYTHON, "-m", "bench.servers.fastapi_plain", "--model", model, "--port", "{port}"],
                "/v2/health/ready",
                cpus=self.plan.server_cpus,
            )
            self.step(f"start FastAPI {model}")
            with server:
                for name in names:
                    self.measure_system(server, "fastapi", name)

    def litserve(self, model: str, batch: int, timeout_s: float, packed: bool = False) -> Server:
        return Server(
            f"litserve-{model}-{batch}-{timeout_s:g}{'-packed' if packed else ''}",
            [
                PYTHON,
                "-m",
                "bench.servers.litserve_server",
                "--model",
                model,
                "--port",
                "{port}",
                "--max-batch-size",
                str(batch),
                "--batch-timeout",
                str(timeout_s),
                *(["--packed"] if packed else []),
            ],
            "/health",
            cpus=self.plan.server_cpus,
        )

    def phase_litserve(self) -> None:
        sweep: list[dict[str, Any]] = []
        for model in ("digits", "minilm"):
            names = [n for n in self.plan.workloads if MODEL_OF[n] == model]
            if not names:
                continue
            sweep += self.litserve_sweep(model, names)
        self.results["litserve_sweep"] = sweep
        best: dict[str, tuple[int, float]] = {}
        for name in self.plan.workloads:
            rows = [s for s in sweep if s["workload"] == name]
            if rows:
                top = max(rows, key=lambda s: (s["rps"], -s["p99_ms"]))
                best[name] = (top["max_batch_size"], top["batch_timeout"])
        self.results["litserve_best"] = {
            k: {"max_batch_size": b, "batch_timeout": t} for k, (b, t) in best.items()
        }
        groups: dict[tuple[str, int, float], list[str]] = {}
        for name, (batch, timeout_s) in best.items():
            groups.setdefault((MODEL_OF[name], batch, timeout_s), []).append(name)
        for (model, batch, timeout_s), names in groups.items():
            self.step(f"start LitServe best {model} {batch}/{timeout_s:g}")
            with self.litserve(model, batch, timeout_s) as server:
                for name in names:
                    head = self.measure_system(server, "litserve", name)
                    if head is not None:
                        head.extra.update({"max_batch_size": batch, "batch_timeout": timeout_s})

    def phase_litserve_packed(self) -> None:
        """LitServe running nograd's packed minilm forward: the same sweep at concurrency 32, its
        best kept as ``litserve-packed``. Separates what nograd's serving adds from what its model
        code (padding skipped) adds, which a LitServe user could write too."""
        names = [n for n in self.plan.workloads if MODEL_OF[n] == "minilm"]
        if not names:
            return
        self.results["litserve_packed_sweep"] = self.litserve_sweep("minilm", names, packed=True)

    def litserve_sweep(
        self, model: str, names: list[str], packed: bool = False
    ) -> list[dict[str, Any]]:
        """Every max_batch_size × batch_timeout of the plan at the headline concurrency."""
        system = "litserve-packed-sweep" if packed else "litserve-sweep"
        sweep: list[dict[str, Any]] = []
        for batch, timeout_s in self.plan.litserve_grid:
            self.step(f"LitServe {model}{' packed' if packed else ''} mbs={batch} t={timeout_s:g}")
            with self.litserve(model, batch, timeout_s, packed=packed) as server:
                for name in names:
                    self.warm(server, name)
                    result = self.load(server, system, name, duration_s=self.plan.sweep_s)
                    if result is None:
                        continue
                    result.extra.update({"max_batch_size": batch, "batch_timeout": timeout_s})
                    sweep.append(
                        {"workload": name, "max_batch_size": batch, "batch_timeout": timeout_s}
                        | result.as_dict()
                    )
        return sweep

    def phase_batching_off(self) -> None:
        """nograd with batches of one: digits max_batch_size = 1; minilm's token cap = the
        longest tokenised text of the workload (no text is refused; two short ones may still
        share a batch, so the measured mean batch size is reported)."""
        longest = self.longest_tokens()
        edits = {
            "digits": {"max_batch_size": "1"},
            "minilm": {"max_batch_tokens": str(longest)},
        }
        self.nograd_variant("nograd-batching-off", edits, {})

    def phase_threads(self) -> None:
        """nograd with one core fewer for torch (leaving one to the event loop) against its
        default of every core."""
        threads = str(max(1, (os.cpu_count() or 1) - 1))
        self.nograd_variant("nograd-threads-fewer", {}, {"NOGRAD_TORCH_THREADS": threads})

    def phase_workers(self) -> None:
        """nograd as two server processes (NOGRAD_WORKERS=2, sharing the cores batch by batch):
        for loads where one process's Python, not the forward, is the limit. minilm-1 also at
        concurrency 1, where a lone request's forward may take every core."""
        self.nograd_variant("nograd-workers-2", {}, WORKERS_2, low_load=True)

    def phase_paired(self) -> None:
        """Interleaved rounds: every system of a workload's targets measured in turn, round
        after round, all of them started once and the ones not under load paused (SIGSTOP).

        On a shared host the machine's speed can move two-fold between phases minutes apart
        (a paired batch-1 yardstick read 13.6-15.1 ms in one phase and 30.4-31.4 ms in a later
        one, with no foreign CPU in the guest), so a ratio of two phases can be a ratio of two
        machine speeds. Here nograd (one process and two workers), LitServe at the best
        configuration its sweep found, the HTTP ceiling (digits; one process, and two as context)
        and the raw forward in its own process (minilm) run back to back on each workload, the
        order reversed every round (ABBA), and each round gives its own ratios; the report takes
        their median. Paused, an idle server takes no CPU from the one measured (LitServe's idle
        workers poll: 0.23 cores of 2, measured).
        """
        best = self.results.get("litserve_best") or {}
        if not best:
            self.note("paired rounds need the litserve phase's best configurations; skipped")
            return
        cpus = self.plan.server_cpus
        lineup: dict[str, list[tuple[str, Server | None]]] = {}
        with contextlib.ExitStack() as stack:

            def up(label: str, server: Server) -> Server:
                self.step(f"paired: start {label}")
                stack.enter_context(server)
                return server

            one = up("nograd", nograd_server(ROOT / "models", cpus))
            two = up("nograd-workers-2", nograd_server(ROOT / "models", cpus, WORKERS_2))
            wait_workers(two, 2)
            litservers: dict[tuple[str, int, float], Server] = {}
            ceilings: list[tuple[str, Server]] = []
            if "digits" in self.plan.workloads:
                # The ceiling (one process), and as context the same app in two
                # processes: the stack's own limit on two cores, where nograd runs two workers.
                ceilings = [
                    ("http-ceiling", up("HTTP ceiling", self.ceiling_server())),
                    (
                        "http-ceiling-2",
                        up("HTTP ceiling, two processes", self.ceiling_server(processes=2)),
                    ),
                ]
            for name in self.plan.workloads:
                config = best.get(name)
                if config is None:
                    continue
                key = (
                    MODEL_OF[name],
                    int(config["max_batch_size"]),
                    float(config["batch_timeout"]),
                )
                if key not in litservers:
                    litservers[key] = up(
                        f"LitServe {key[0]} {key[1]}/{key[2]:g}", self.litserve(*key)
                    )
                lineup[name] = [
                    ("nograd", one),
                    ("nograd-workers-2", two),
                    ("litserve", litservers[key]),
                ]
                if name == "digits":
                    lineup[name] += ceilings
                if MODEL_OF[name] == "minilm":
                    # The raw forward in its own process, every server paused: the yardstick of
                    # the raw-model target, at this round's machine speed.
                    lineup[name].append(("raw", None))
            everyone = [one, two, *litservers.values(), *(server for _, server in ceilings)]
            rounds: list[dict[str, Any]] = []
            raw: list[dict[str, Any]] = []
            for index in range(self.plan.paired_rounds):
                for name, systems in lineup.items():
                    order = systems if index % 2 == 0 else systems[::-1]
                    for position, (system, server) in enumerate(order):
                        # Only the server under load runs; the others are paused (SIGSTOP).
                        for other in everyone:
                            if other is server:
                                other.resume()
                            else:
                                other.pause()
                        if server is None:
                            self.step(f"paired round {index + 1}: raw model for {name}")
                            raw.append(
                                {"round": index + 1, "position": position, "workload": name}
                                | self.raw_limit_now()
                            )
                            continue
                        result = self.headline(
                            server,
                            system,
                            name,
                            f"paired round {index + 1}: {system} {name}",
                            nograd_metrics=system.startswith("nograd"),
                            keep=False,
                        )
                        if result is None:
                            continue
                        rounds.append({"round": index + 1, "position": position} | result.as_dict())
        self.results["paired"] = {"litserve_best": best, "runs": rounds, "raw": raw}

    def ceiling_server(self, processes: int = 1) -> Server:
        return Server(
            "ceiling" if processes == 1 else f"ceiling-{processes}",
            [
                *(PYTHON, "-m", "bench.servers.http_ceiling"),
                *("--port", "{port}", "--processes", str(processes)),
            ],
            "/v2/health/ready",
            cpus=self.plan.server_cpus,
        )

    def nograd_variant(
        self,
        system: str,
        edits: dict[str, dict[str, str]],
        env: dict[str, str],
        *,
        low_load: bool = False,
    ) -> None:
        repo = temp_repository(edits) if edits else None
        try:
            server = nograd_server(repo or ROOT / "models", self.plan.server_cpus, env)
            self.step(f"start {system}")
            with server:
                wait_workers(server, int(env.get("NOGRAD_WORKERS", "1")))
                for name in self.plan.workloads:
                    result = self.headline(
                        server, system, name, f"{system} {name}", nograd_metrics=True
                    )
                    if result is not None:
                        result.extra["config"] = edits.get(MODEL_OF[name], {}) | env
                    if low_load and name == "minilm-1":
                        self.step(f"{system} {name} c=1")
                        self.load(
                            server,
                            system,
                            name,
                            concurrency=1,
                            duration_s=self.plan.short_s,
                            nograd_metrics=True,
                        )
        finally:
            if repo is not None:
                shutil.rmtree(repo, ignore_errors=True)

    def longest_tokens(self) -> int:
        from bench.models import MODELS, import_file

        code = import_file(MODELS / "minilm" / "model.py", "bench_models_minilm_tok")
        source = code.package_model_dir()
        tokenizer = code.load_tokenizer(source, code.max_seq_length(source))
        texts = workloads.sentences(workloads.BODIES_PER_WORKLOAD * 8, seed=workloads.SEED + 8)
        texts += workloads.sentences(workloads.BODIES_PER_WORKLOAD)
        return max(len(e.ids) for e in tokenizer.encode_batch(texts))

    def phase_levers(self) -> None:
        seconds = "0.2" if self.plan.quick else "0.5"
        if self.plan.levers:
            self.step("levers: grad modes, bf16")
            out = RESULTS / f"{self.stamp}-levers.json"
            self.quiet()
            foreign = self.subprocess(
                [PYTHON, "-m", "bench.levers", "--out", str(out), "--seconds", seconds],
                timeout_s=900,
                cpus=self.plan.server_cpus,
            )
            self.results["levers"] = orjson.loads(out.read_bytes())
            self.results["levers"]["foreign_cpu_cores"] = foreign
            out.unlink()
        if self.plan.compile:
            self.step("levers: torch.compile")
            out = RESULTS / f"{self.stamp}-compile.json"
            cache = Path(tempfile.gettempdir()) / f"torchinductor_{os.environ.get('USER', 'root')}"
            warm_cache = cache.exists()
            try:
                self.subprocess(
                    [
                        PYTHON,
                        "-m",
                        "bench.levers",
                        "--only",
                        "compile",
                        "--out",
                        str(out),
                        "--seconds",
                        seconds,
                    ],
                    timeout_s=420,
                    cpus=self.plan.server_cpus,
                )
                self.results["compile"] = orjson.loads(out.read_bytes())
                out.unlink()
            except (subprocess.TimeoutExpired, subprocess.CalledProcessError, OSError) as exc:
                self.results["compile"] = {"skipped": f"{type(exc).__name__}: {exc}"[:400]}
            self.results.setdefault("compile", {})["inductor_cache_warm"] = warm_cache

    def phase_memory(self) -> None:
        if not self.plan.memory:
            return
        self.step("memory benchmark (issue 3)")
        out = RESULTS / f"{self.stamp}-memory.json"
        duration = "3" if self.plan.quick else "8"
        self.subprocess(
            [PYTHON, "-m", "bench.memory_bench", "--out", str(out), "--duration", duration],
            timeout_s=900,
        )
        self.results["memory"] = orjson.loads(out.read_bytes())
        out.unlink()

    def phase_torch_profile(self) -> None:
        if not self.plan.profile:
            return
        self.step("torch.profiler on nograd's batch path")

        def mean_batch(name: str, default: int) -> int:
            for r in self.runs:
                if (
                    r.system == "nograd"
                    and r.workload == name
                    and r.concurrency == self.plan.concurrency
                ):
                    return max(1, round(float(r.extra.get("mean_batch_size", default))))
            return default

        out = RESULTS / f"{self.stamp}-torchprof.json"
        command = [
            PYTHON,
            "-m",
            "bench.profile_nograd",
            "torch",
            "--out",
            str(out),
            "--digits-batch",
            str(mean_batch("digits", 16)),
            "--minilm-batch",
            str(mean_batch("minilm-1", 8)),
        ]
        self.quiet()
        foreign = self.subprocess(command, timeout_s=600, cpus=self.plan.server_cpus)
        self.results["torch_profile"] = orjson.loads(out.read_bytes())
        self.results["torch_profile"]["foreign_cpu_cores"] = foreign
        out.unlink()

    def pyspy(self, server: Server, name: str) -> dict[str, Any]:
        from bench.profile_nograd import pyspy_categories

        spy = shutil.which("py-spy") or str(Path(PYTHON).parent / "py-spy")
        raw = RESULTS / f"{self.stamp}-pyspy-{name}.txt"
        rate = 100
        seconds = max(3, int(self.plan.duration_s))
        command = [spy, "record", "-p", str(server.pid), "-d", str(seconds), "-r", str(rate)]
        command += ["-f", "raw", "-o", str(raw), "--threads", "--nonblocking"]
        try:
            recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except OSError as exc:
            return {"error": f"py-spy: {exc}"}
        try:
            time.sleep(0.5)
            result = self.load(
                server, "nograd-profiled", name, duration_s=seconds - 1, record=False
            )
            _, err = recorder.communicate(timeout=seconds + 30)
            if result is None:
                return {"error": "the load run under py-spy failed"}
        finally:
            if recorder.poll() is None:
                recorder.kill()
                recorder.wait()
        if not raw.exists():
            return {"error": f"py-spy wrote nothing: {err.decode(errors='replace')[-400:]}"}
        summary = pyspy_categories(raw, rate, result.requests)
        summary["load"] = result.as_dict()
        summary["raw_file"] = raw.name
        return summary

    def raw_limit_now(self) -> dict[str, Any]:
        """minilm's raw forward (padded, and nograd's packed one) at the batch sizes where it
        peaks, in its own process pinned like the servers: one paired round's raw limit."""
        result, foreign = self.run_raw(
            [
                *("--models", "minilm", "--skip-batch1", "--batches", PAIRED_RAW_BATCHES),
                *("--rounds", "1", "--seconds", "1.0"),
            ],
            300,
        )
        data = result["minilm"]
        return {
            "samples_per_s": data["best"]["samples_per_s"],
            "batch": data["best"]["batch"],
            "packed_samples_per_s": data["packed_best"]["samples_per_s"],
            "packed_batch": data["packed_best"]["batch"],
            "foreign_cpu_cores": foreign,
        }

    def raw_batch1(self) -> float:
        """minilm's batch-1 forward p50 (ms) over the workload's sentences, in its own process
        pinned like the server (``bench.raw --batch1``), while the server idles."""
        result, _ = self.run_raw(["--batch1"], 300)
        return float(result["minilm"]["batch1_p50_ms"])

    def run_raw(self, args: list[str], timeout_s: float) -> tuple[dict[str, Any], float]:
        """``bench.raw`` with ``args`` in its own process pinned like the servers: its results,
        and other processes' CPU (cores) meanwhile."""
        out = RESULTS / f"{self.stamp}-raw-{os.getpid()}.json"
        command = [PYTHON, "-m", "bench.raw", *args, "--out", str(out)]
        try:
            foreign = self.subprocess(command, timeout_s=timeout_s, cpus=self.plan.server_cpus)
            return orjson.loads(out.read_bytes()), foreign
        finally:
            out.unlink(missing_ok=True)

    def subprocess(self, command: list[str], timeout_s: float, cpus: str | None = None) -> float:
        """Run a bench step in its own process; returns other processes' CPU (cores) meanwhile."""
        from bench.common import pinned

        busy = _machine_busy_s()
        children = os.times()
        started = time.perf_counter()
        out = subprocess.run(
            pinned(command, cpus),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        wall = time.perf_counter() - started
        after = os.times()
        own = (after.children_user - children.children_user) + (
            after.children_system - children.children_system
        )
        if out.returncode != 0:
            raise subprocess.CalledProcessError(
                out.returncode, command, out.stdout, out.stderr[-3000:]
            )
        return max(0.0, _machine_busy_s() - busy - own) / max(wall, 1e-9)


class CpuWatch:
    """CPU used during one run: by the server's process tree, and by everything else."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.started = time.perf_counter()
        self.busy = _machine_busy_s()
        self.server = _tree_cpu_s(pid)

    def finish(self, result: LoadResult) -> dict[str, float]:
        wall = time.perf_counter() - self.started
        busy = _machine_busy_s() - self.busy
        server = _tree_cpu_s(self.pid) - self.server
        generator = (result.generator_cpu_share or 0.0) * result.duration_s
        return {
            "server_cpu_cores": server / wall,
            "machine_busy_cores": busy / wall,
            "foreign_cpu_cores": max(0.0, busy - server - generator) / wall,
            "requests_per_server_cpu_s": result.requests / server if server > 0 else 0.0,
        }


def _machine_busy_s() -> float:
    with open("/proc/stat") as handle:
        fields = [float(x) for x in handle.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(pid: int) -> float:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def wait_workers(server: Server, workers: int, timeout_s: float = 300.0) -> None:
    """Measure only once every worker reports in: a worker that failed or restarted would leave
    the others serving alone and the numbers would be those of fewer workers."""
    deadline = time.monotonic() + timeout_s
    while metric(scrape(server.url), "nograd_workers_ready") < workers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name}: {workers} workers not ready after {timeout_s}s")
        time.sleep(0.5)


def temp_repository(edits: dict[str, dict[str, str]]) -> Path:
    from bench.memory_bench import _temp_repository

    return _temp_repository({name: ROOT / "models" / name for name in edits}, edits)


def wait_quiet(limit_s: float, threshold_cores: float = QUIET_CORES) -> float:
    """Wait (up to ``limit_s``) until the machine's other processes use < threshold cores."""
    deadline = time.monotonic() + limit_s
    busy = 0.0
    while True:
        before = _machine_busy_s()
        time.sleep(2.0)
        busy = (_machine_busy_s() - before) / 2.0
        if busy < threshold_cores or time.monotonic() >= deadline:
            return busy


def count_steps(plan: Plan) -> int:
    per_system = 1 + len(plan.sweep_concurrencies) + len(plan.open_fractions)
    n_wl = len(plan.workloads)
    has_digits = "digits" in plan.workloads
    models = len({MODEL_OF[w] for w in plan.workloads})
    steps = 1  # raw
    steps += 1 + n_wl * per_system + (2 if plan.profile else 0)  # nograd
    steps += (1 + per_system) if has_digits else 0  # ceiling
    steps += models + n_wl * per_system  # fastapi
    steps += models * len(plan.litserve_grid) + n_wl * per_system + 2  # litserve
    steps += len(plan.litserve_grid) if "minilm" in {MODEL_OF[w] for w in plan.workloads} else 0
    steps += 3 * (2 + n_wl)  # batching off, fewer torch threads, two workers
    steps += int("minilm-1" in plan.workloads)  # two workers at concurrency 1
    systems = 3 * n_wl + 2 * int(has_digits)  # nograd, two workers, LitServe (+ 2 ceilings)
    minilm_workloads = sum(1 for w in plan.workloads if MODEL_OF[w] == "minilm")
    systems += minilm_workloads  # the raw forward beside each minilm workload
    steps += 3 + models + 2 * int(has_digits) + plan.paired_rounds * systems  # paired rounds
    steps += int(plan.levers) + int(plan.compile) + int(plan.memory) + int(plan.profile)
    return steps


@contextlib.contextmanager
def progress_bar(total: int) -> Iterator[Any]:
    if tqdm is None:
        yield None
        return
    bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
    try:
        yield bar
    finally:
        bar.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="~5 minute smoke run: shorter runs, fewer configs"
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=None, help="headline run seconds")
    parser.add_argument("--workloads", default=",".join(workloads.ALL))
    parser.add_argument(
        "--pin",
        choices=("none", "split"),
        default="none",
        help="split: server (and raw model) on core 0, load generator on core 1",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each phase, wait up to S seconds for other processes to go quiet",
    )
    parser.add_argument(
        "--attempts",
        type=int,
        default=None,
        help="tries per run while other processes disturb it (default 3; 1 with --quick)",
    )
    parser.add_argument("--quiet-wait", type=float, default=20.0, metavar="S")
    parser.add_argument("--quiet-budget", type=float, default=600.0, metavar="S")
    parser.add_argument(
        "--paired-rounds",
        type=int,
        default=None,
        help=f"interleaved rounds of the paired phase (default {PAIRED_ROUNDS}; 2 with --quick)",
    )
    parser.add_argument("--skip-levers", action="store_true")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-profile", action="store_true")
    parser.add_argument(
        "--phases",
        default=None,
        help="comma-separated subset of: " + ",".join(ALL_PHASES),
    )
    args = parser.parse_args(argv)
    if args.phases is None:
        # --quick is a smoke run: every kind of measurement once, without the thread variant.
        args.phases = ",".join(p for p in ALL_PHASES if not (args.quick and p == "threads"))

    if not loadgen.have_wrk():
        print("wrk not found: apt-get install -y wrk (make bench does this)", file=sys.stderr)
        return 2
    plan = Plan.from_args(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    bench = Bench(plan, stamp)
    for name in plan.workloads:
        bench.bodies[name] = workloads.make(name).write_bodies(RESULTS / "bodies")
    bench.results["meta"] = {
        **machine(),
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "command": "python -m bench.run " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "plan": plan.__dict__,
    }
    phases: dict[str, Callable[[], None]] = {
        "raw": bench.phase_raw,
        "nograd": bench.phase_nograd,
        "ceiling": bench.phase_ceiling,
        "fastapi": bench.phase_fastapi,
        "litserve": bench.phase_litserve,
        "litserve_packed": bench.phase_litserve_packed,
        "batching_off": bench.phase_batching_off,
        "threads": bench.phase_threads,
        "workers": bench.phase_workers,
        "paired": bench.phase_paired,
        "levers": bench.phase_levers,
        "memory": bench.phase_memory,
        "torch_profile": bench.phase_torch_profile,
    }
    started = time.monotonic()
    failures: dict[str, str] = {}
    with progress_bar(count_steps(plan)) as bar:
        bench.progress = bar
        for phase in args.phases.split(","):
            if args.wait_quiet > 0:
                busy = wait_quiet(args.wait_quiet)
                bench.results["meta"].setdefault("busy_before_phase", {})[phase] = busy
            try:
                phases[phase]()
            except Exception as exc:  # one broken phase must not lose the others' numbers
                failures[phase] = f"{type(exc).__name__}: {exc}"[-2000:]
                bench.note(f"phase {phase} failed: {failures[phase][:300]}")
    bench.results["meta"]["elapsed_s"] = time.monotonic() - started
    bench.results["meta"]["noisy_retries"] = bench.noisy_retries
    bench.results["meta"]["quiet_wait_spent_s"] = bench.quiet_spent_s
    bench.results["meta"]["loadavg_at_end"] = os.getloadavg()
    bench.results["failures"] = failures
    bench.results["runs"] = [r.as_dict() for r in bench.runs]

    from bench.report import markdown, plot

    json_path = RESULTS / f"{stamp}.json"
    json_path.write_bytes(
        orjson.dumps(bench.results, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    )
    png_path = RESULTS / f"{stamp}.png"
    plot(bench.results, png_path)
    md_path = RESULTS / f"{stamp}.md"
    md_path.write_text(markdown(bench.results))
    print(f"results: {json_path}\nplot:    {png_path}\ntables:  {md_path}")
    print(md_path.read_text().split("\n## ", 2)[1] if "\n## " in md_path.read_text() else "")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
