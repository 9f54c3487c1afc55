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
   all started once and measured in turn (the others paused), round after round, order
   reversed each round, so each round's ratios compare systems at the same machine speed;
6. engines: nograd as shipped (``engine = "auto"``) against ``NOGRAD_ENGINE=eager``, paired,
   and each engine's raw forward (``bench.engine_speed``);
7. peers: real Triton (PyTriton), TorchServe and infinity (torch and ONNX engines), each in its
   own pinned venv under ``bench/.peers/`` built on first use (``bench.peers``), answers checked
   against nograd's before any number counts, a few batching configurations each, then the best
   of each paired with nograd (its default worker count) and the HTTP ceiling, at concurrency 32
   and 1; a peer that cannot be set up or started is reported with the reason;
8. archives: TorchServe's MNIST example (``mnist.mar``, its custom handler) built with the real
   ``torch-model-archiver``, one model store served by nograd (as shipped and as one process)
   and by TorchServe, their answers compared, then paired rounds of ``PUT /predictions/mnist``
   with PNG bodies at the headline concurrency and at the archive's batch size
   (``bench.phases.archives``);
9. gRPC: Triton's perf_analyzer drives nograd (one process and two workers) over HTTP and over
   gRPC, and Triton (PyTriton) over gRPC, in paired rounds at concurrency 32 and 1;
10. speed levers (``bench.levers``), issue 3's memory benchmark (``bench.memory_bench``) and
   torch.profiler on nograd's batch path (``bench.profile_nograd``);
11. fleet: 3 on-demand replicas behind HAProxy (``nograd fleet``), 24 ONNX models of 32 MiB,
   Zipf clients: model-aware balancing against round robin in paired rounds, then a rolling
   restart and a scale to 4 replicas under load (``bench.phases.fleet``; needs Debian's
   ``haproxy``).

On request only (``--phases revisions --base REV``): this checkout's nograd against the same
server at revision REV, both up together, answers compared, then paired rounds on digits, minilm
and TorchServe's MNIST archive at concurrency 1 and the headline (``bench.phases.revisions``).
``--phases processes``: this checkout's nograd as one engine process with fronts
(``NOGRAD_FRONTS``) against its workers (``NOGRAD_WORKERS``): the processes that map libtorch,
the process group's PSS, cold and warm start-up (each alone), the processes holding a load's
connections, answers compared, then paired rounds on digits and minilm-1
(``bench.phases.processes``); with ``--base REV`` the workers of revision REV join each step.

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
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from bench import loadgen, workloads
from bench.common import RESULTS, machine
from bench.peers.servers import MODELS_OF_SYSTEM, SWEEPS
from bench.phases import (
    archives,
    engines,
    fleet,
    litserve,
    over_grpc,
    paired,
    peers,
    processes,
    profiling,
    residency,
    revisions,
    single,
)
from bench.plan import PAIRED_ROUNDS, Plan
from bench.session import MODEL_OF, Bench, wait_quiet

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is in the bench extra
    tqdm = None

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
    "engines",
    "peers",
    "archives",
    "residency",
    "grpc",
    "levers",
    "memory",
    "torch_profile",
    "fleet",
)
ON_REQUEST = ("revisions", "processes")
"""Phases a run makes only when ``--phases`` names them."""


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
    # nograd, two workers, LitServe (+ 2 ceilings on digits)
    systems = 3 * n_wl + 2 * int(has_digits)
    minilm_workloads = sum(1 for w in plan.workloads if MODEL_OF[w] == "minilm")
    systems += minilm_workloads  # the raw forward beside each minilm workload
    steps += 3 + models + 2 * int(has_digits) + plan.paired_rounds * systems  # paired rounds
    steps += 2 + plan.paired_rounds * n_wl * 2 * 2  # engines: auto and eager at c=1 and c=32
    # peers: three venvs, a sweep per peer system and model, every server started, then paired
    # rounds of nograd, the ceiling (digits) and the peer systems at two concurrencies
    peer_models = [
        (system, model)
        for system, served in MODELS_OF_SYSTEM.items()
        for model in served
        if model in {MODEL_OF[w] for w in plan.workloads}
    ]
    steps += 3 + sum(1 if plan.quick else len(SWEEPS[s]) for s, _ in peer_models)
    steps += 1 + int(has_digits) + len(peer_models)
    per_round = sum(
        1 + int(w == "digits") + sum(1 for s, m in peer_models if m == MODEL_OF[w])
        for w in plan.workloads
    )
    steps += plan.paired_rounds * 2 * per_round
    # archives: TorchServe's venv, the archive, three servers, the answer check, then per round
    # every server at two concurrencies
    steps += 6 + plan.paired_rounds * 2 * 3
    # gRPC: two nograds and PyTriton's venv, PyTriton per workload, then per round and
    # concurrency both nograds over both protocols and PyTriton over gRPC
    one_sample = sum(1 for w in plan.workloads if workloads.make(w, 1).samples_per_request == 1)
    steps += 3 + one_sample + plan.paired_rounds * 2 * 5 * one_sample
    steps += int(plan.levers) + int(plan.compile) + int(plan.memory) + int(plan.profile)
    steps += 4  # residency: build, cold and resident, a working set that fits, one that does not
    # revisions: the checkout, the repository, two servers, an answer check per workload, then
    # per round both servers on each workload at two concurrencies
    revised = len(plan.revision_workloads)
    steps += 4 + revised + plan.paired_rounds * revised * 2 * 2
    # processes: a cold and a warm start of each system per start round, each started again,
    # an answer check per workload, the connections of each, then per round each system on
    # both workloads at two concurrencies
    processes = 2 if plan.base_revision is None else 3  # with --base, the base's workers too
    steps += processes * (2 * plan.process_starts + 3) + plan.paired_rounds * processes * 2 * 2
    # fleet: the models, both balances per round, the rolling restart and the scale
    steps += 1 + 2 * plan.fleet_rounds + 2
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


def command_line() -> argparse.ArgumentParser:
    """The command line; tests build plans from it as a run does."""
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
        help=f"rounds of the paired, engines, peers and grpc phases (default {PAIRED_ROUNDS}; "
        "2 with --quick)",
    )
    parser.add_argument(
        "--base",
        default=None,
        metavar="REV",
        help="the revisions phase: the git revision this checkout's nograd is paired against; "
        "the processes phase: the revision whose workers join as the baseline",
    )
    parser.add_argument(
        "--revision-workers",
        default="1",
        metavar="N",
        help="NOGRAD_WORKERS of both servers in the revisions phase (default 1)",
    )
    parser.add_argument(
        "--revision-workloads",
        default="digits,minilm-1,mnist-png",
        metavar="W,...",
        help="the revisions phase's workloads (default digits,minilm-1,mnist-png)",
    )
    parser.add_argument(
        "--process-workers",
        default="2",
        metavar="N",
        help="the processes phase: NOGRAD_WORKERS of its workers system (default 2)",
    )
    parser.add_argument(
        "--process-fronts",
        default="auto",
        metavar="N",
        help="the processes phase: NOGRAD_FRONTS of its engine system (default auto: the "
        "processes make run starts)",
    )
    parser.add_argument(
        "--process-starts",
        type=int,
        default=1,
        metavar="N",
        help="the processes phase: cold and warm starts of each system, timed alone (default 1)",
    )
    parser.add_argument(
        "--fleet-seconds",
        type=float,
        default=None,
        metavar="S",
        help="the fleet phase: seconds of clients per balance and round (default 60; 15 with "
        "--quick)",
    )
    parser.add_argument(
        "--fleet-rounds",
        type=int,
        default=None,
        metavar="N",
        help="the fleet phase: paired rounds of both balances (default 2; 1 with --quick)",
    )
    parser.add_argument(
        "--residency-seconds",
        type=float,
        default=None,
        metavar="S",
        help="the residency phase's one-server Zipf run (default 60; 10 with --quick)",
    )
    parser.add_argument("--skip-levers", action="store_true")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-profile", action="store_true")
    parser.add_argument(
        "--phases",
        default=None,
        help="comma-separated subset of: " + ",".join(ALL_PHASES + ON_REQUEST),
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = command_line().parse_args(argv)
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
    phases: dict[str, Callable[[Bench], None]] = {
        "raw": single.phase_raw,
        "nograd": single.phase_nograd,
        "ceiling": single.phase_ceiling,
        "fastapi": single.phase_fastapi,
        "litserve": litserve.phase_litserve,
        "litserve_packed": litserve.phase_litserve_packed,
        "batching_off": single.phase_batching_off,
        "threads": single.phase_threads,
        "workers": single.phase_workers,
        "paired": paired.phase_paired,
        "engines": engines.phase_engines,
        "peers": peers.phase_peers,
        "archives": archives.phase_archives,
        "residency": residency.phase_residency,
        "revisions": revisions.phase_revisions,
        "processes": processes.phase_processes,
        "grpc": over_grpc.phase_grpc,
        "levers": profiling.phase_levers,
        "memory": profiling.phase_memory,
        "torch_profile": profiling.phase_torch_profile,
        "fleet": fleet.phase_fleet,
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
                phases[phase](bench)
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
    md_path = RESULTS / f"{stamp}.md"
    md_path.write_text(markdown(bench.results))
    png_path = RESULTS / f"{stamp}.png"
    try:
        plot(bench.results, png_path)
    except ImportError as exc:  # the bench extra's matplotlib; make bench installs it
        png_path = Path(f"(no plot: {exc})")
    print(f"results: {json_path}\nplot:    {png_path}\ntables:  {md_path}")
    print(md_path.read_text().split("\n## ", 2)[1] if "\n## " in md_path.read_text() else "")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
