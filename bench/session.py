"""A bench run's state and its measuring steps: load runs, noise checks, raw-forward yardsticks,
and the helpers phases share (CPU accounting, worker readiness, temporary repositories)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench import loadgen, workloads
from bench.common import PYTHON, RESULTS, ROOT, Server, metric
from bench.common import scrape_metrics as scrape
from bench.loadgen import LoadResult
from bench.peers.protocol import route, write_peer_bodies
from bench.perf_analyzer import perf_analyzer_load
from bench.plan import PAIRED_RAW_BATCHES, Plan

QUIET_CORES = 0.3
"""Other processes' CPU (in cores) above which a run counts as disturbed."""
MODEL_OF = {"digits": "digits", "minilm-1": "minilm", "minilm-8": "minilm", "mnist-png": "mnist"}
WORKERS_2 = {"NOGRAD_WORKERS": "2"}


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
        perf_analyzer: str | None = None,
    ) -> LoadResult:
        """One measured run against ``server``: closed loop (wrk, or perf_analyzer over the
        protocol ``perf_analyzer`` names) or open loop (rate, wrk's HTTP bodies)."""
        if perf_analyzer is not None and rate is not None:
            raise ValueError("perf_analyzer runs a closed loop here: no fixed rate")
        wl = self.workload(name)
        if wl.binary and (rate is not None or perf_analyzer is not None):
            raise ValueError(f"{name}: raw bodies are sent by wrk's closed loop only")
        url, bodies = self.target(server, name)
        # The concurrency-1 target's yardstick, measured beside the load (before and after it):
        # the forward's speed moves with the machine's between a run's phases.
        paired = (
            system.startswith("nograd")
            and name == "minilm-1"
            and concurrency == 1
            and perf_analyzer is None
        )
        raw_before = self.raw_batch1() if paired else None
        cpu = CpuWatch(server.pid)
        before = scrape(server.url) if nograd_metrics else {}
        if perf_analyzer is not None:
            result = perf_analyzer_load(
                server,
                wl,
                perf_analyzer,
                system=system,
                concurrency=concurrency or self.plan.concurrency,
                duration_s=duration_s,
                cpus=self.plan.generator_cpus,
                directory=self.bodies[name].parent,
            )
        elif rate is None:
            result = loadgen.run_closed(
                url,
                bodies,
                system=system,
                workload=name,
                samples_per_request=wl.samples_per_request,
                connections=concurrency or self.plan.concurrency,
                duration_s=duration_s,
                cpus=self.plan.generator_cpus,
                method=wl.method,
                content_type=wl.content_type,
                hex_bodies=wl.binary,
            )
        else:
            result = loadgen.run_open(
                url,
                bodies,
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
            # Every answer the server gave during the run, its start-up and end included, for its
            # CPU per request over the same span as its CPU.
            result.extra["server_answers"] = metric(
                after, "nograd_requests_total", model=model
            ) - metric(before, "nograd_requests_total", model=model)
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

    def target(self, server: Server, name: str) -> tuple[str, Path]:
        """The URL and bodies file of workload ``name`` on ``server``: nograd's V2 route and
        bodies, or a peer's own route with the same requests in its format."""
        if server.peer is None:
            return server.url + self.workload(name).path, self.bodies[name]
        where = route(server.peer, name)
        key = f"{name}:{where.body_format}"
        if key not in self.bodies:
            directory = self.bodies[name].parent
            self.bodies[key] = write_peer_bodies(self.workload(name), where.body_format, directory)
        return server.url + where.path, self.bodies[key]

    def warm(
        self,
        server: Server,
        name: str,
        concurrency: int | None = None,
        perf_analyzer: str | None = None,
    ) -> None:
        """A short run at the same concurrency, with the same generator, before a measured one."""
        self.load(
            server,
            "warmup",
            name,
            concurrency=concurrency,
            duration_s=self.plan.warmup_s,
            record=False,
            perf_analyzer=perf_analyzer,
        )

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
            "server_cpu_s": server,
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


def pyspy(bench: Bench, server: Server, name: str) -> dict[str, Any]:
    from bench.profile_nograd import pyspy_categories

    spy = shutil.which("py-spy") or str(Path(PYTHON).parent / "py-spy")
    raw = RESULTS / f"{bench.stamp}-pyspy-{name}.txt"
    rate = 100
    seconds = max(3, int(bench.plan.duration_s))
    command = [spy, "record", "-p", str(server.pid), "-d", str(seconds), "-r", str(rate)]
    command += ["-f", "raw", "-o", str(raw), "--threads", "--nonblocking"]
    try:
        recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except OSError as exc:
        return {"error": f"py-spy: {exc}"}
    try:
        time.sleep(0.5)
        result = bench.load(server, "nograd-profiled", name, duration_s=seconds - 1, record=False)
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


def longest_tokens(bench: Bench) -> int:
    from bench.models import MODELS, import_file

    code = import_file(MODELS / "minilm" / "model.py", "bench_models_minilm_tok")
    source = code.package_model_dir()
    tokenizer = code.load_tokenizer(source, code.max_seq_length(source))
    texts = workloads.sentences(workloads.BODIES_PER_WORKLOAD * 8, seed=workloads.SEED + 8)
    texts += workloads.sentences(workloads.BODIES_PER_WORKLOAD)
    return max(len(e.ids) for e in tokenizer.encode_batch(texts))
