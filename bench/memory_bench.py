"""Memory benchmark: measured memory per engine, derived batch limits, and serving under a budget.

Part A (in process, nograd's own code paths, as ``nograd/serving/loading.py`` calls them): for
each shipped model and each engine (eager, ONNX Runtime, torch.export; AOTInductor with
``--engines``), ``build_handler`` → ``prepare_engine`` with that engine forced →
``profile_handler``, which measures each engine as it allocates (the process's resident peak on
CPU) → each range's fit, its verdict and check errors; then ``plan_device`` with explicit
budgets → the batch limit each budget gives, and the measured peak of a batch at that limit,
through the same engine's probe (it must stay within the budget): the planned bytes per sample
(or token) against what a batch really took.

Part B (served by ``nograd`` under wrk, concurrency 32):
* digits with the default budget vs a small ``NOGRAD_MEMORY_BUDGET_BYTES`` whose limit is 4
  samples: throughput, latency, the batch sizes that actually ran (``nograd_batch_size``);
* the fault-injecting ``tests/fixtures/models/oomy`` model (raises ``torch.OutOfMemoryError`` for
  any batch above 5 rows: an out-of-memory on CPU without exhausting the machine) served with
  ``max_batch_size = 5`` (what a correct memory limit gives) vs ``max_batch_size = 64`` (a fixed
  cap that overruns it, as other servers are configured): throughput, errors (there should be
  none), ``nograd_oom_total``, ``nograd_batch_splits_total`` and the learned ``nograd_batch_limit``.

``python -m bench.memory_bench --out FILE [--duration S] [--engines eager,onnx,...]
[--skip-served]``; ``bench.run`` calls it too. Without wrk, part B is skipped.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import orjson
import torch

from bench import loadgen, workloads
from bench.common import ROOT, metric, nograd_server, scrape_metrics

BUDGETS = (64 * 1024, 256 * 1024, 1024**2, 16 * 1024**2, 64 * 1024**2, 256 * 1024**2)
ENGINES = ("eager", "onnx", "torch_export")
OOMY = ROOT / "tests" / "fixtures" / "models" / "oomy"


def profile_models(
    names: tuple[str, ...] = ("digits", "minilm"), engines: tuple[str, ...] = ENGINES
) -> dict[str, dict[str, Any]]:
    """Per model, per engine forced: the fits the plan makes and the limits it derives."""
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="nograd-bench-engines-") as cache:
        for name in names:
            out[name] = {engine: profile_engine(name, engine, Path(cache)) for engine in engines}
    return out


def profile_engine(name: str, engine: str, cache: Path) -> dict[str, Any]:
    from nograd.runtime.engines.choice import prepare_engine
    from nograd.runtime.engines.paths import engine_weights_bytes, serving_ranges
    from nograd.runtime.handler import ModelHandler, TorchRunner
    from nograd.runtime.loader import build_handler, locate
    from nograd.runtime.memory import probe_for
    from nograd.runtime.planner import PlanInput, per_unit_bytes, plan_device, profile_handler
    from nograd.schema.config import find_config, load_config
    from nograd.serving.loading import configured_limit
    from nograd.settings import Settings

    repository = ROOT / "models"
    device = torch.device("cpu")
    path = find_config(repository / name)
    assert path is not None
    # Forced: served whatever its speed against eager, so every engine's memory is measured.
    config = load_config(path, override={"engine": engine, "min_speedup": 0})
    handler = build_handler(repository, repository / name, config, device)
    assert isinstance(handler, ModelHandler), "a torch model's engines are measured"
    cap = configured_limit(config, Settings().max_batch_size)
    code = [locate(repository / name, config.module)]
    handler = prepare_engine(handler, cap, None, None, code, cache)
    probe = probe_for(device)
    cost = profile_handler(handler, probe, cap)
    weights = handler.weights_bytes + engine_weights_bytes(handler.speed_path)
    tokens = config.batch_unit == "tokens"
    unit = "token" if tokens else "sample"
    entry: dict[str, Any] = {
        "serving": handler.speed_mode,
        "unit": unit,
        "cap": cap,
        "weights_bytes": weights,
        "ranges": [],
        "budgets": [],
    }
    engines = dict((e.name, e) for _, e in serving_ranges(handler))
    for item in cost.ranges:
        fit, check = item.fit, item.fit.profile.check_point
        entry["ranges"].append(
            {
                "engine": item.engine,
                "most_rows": item.most_rows,
                "verdict": str(fit.verdict),
                "errors": list(fit.errors),
                "fixed_bytes": fit.model.fixed,
                "per_unit_bytes": fit.model.per_unit,
                "quadratic_bytes": fit.model.quadratic,
                "points": [list(point) for point in fit.profile.points],
                "check": {
                    "rows": check.rows,
                    "length": check.length,
                    "measured_bytes": check.measured_bytes,
                    "predicted_bytes": check.predicted_bytes,
                },
            }
        )
    for budget in BUDGETS:
        _, plans = plan_device(
            [PlanInput(name, handler, weights, cap)],
            {name: cost},
            probe,
            fraction=0.9,
            explicit_bytes=budget,
        )
        plan = plans[0]
        row: dict[str, Any] = {"budget_bytes": budget, "limit": plan.limit}
        if plan.limit >= 1:
            # A batch at the limit, measured through the probe of the engine serving it: token
            # models at the length the plan budgets them at, as many rows as the limit allows.
            length = plan.reference_length if tokens else 1
            rows = plan.limit_rows
            serving = cost.fit_for(rows)
            runner = TorchRunner(handler, path=engines[serving.engine])
            example = handler.example(rows, length)
            parts = [example.slice(i, i + 1) for i in range(rows)]
            measured = engines[serving.engine].memory_probe(probe)
            peak = measured.measure_peak(functools.partial(runner.run_batch, parts))
            row.update(
                {
                    "engine": serving.engine,
                    "planned_unit_bytes": per_unit_bytes(serving.fit.model, unit, length),
                    "measured_rows": rows,
                    "measured_length": length,
                    "predicted_bytes": cost.predict(rows, length),
                    "measured_peak_bytes": peak,
                }
            )
        entry["budgets"].append(row)
    return entry


def _temp_repository(models: dict[str, Path], edits: dict[str, dict[str, str]]) -> Path:
    """A throwaway model repository: copies of model folders with config lines replaced."""
    root = Path(tempfile.mkdtemp(prefix="nograd-bench-repo-"))
    for name, source in models.items():
        target = root / name
        shutil.copytree(source, target)
        config = target / "config.toml"
        text = config.read_text()
        for key, value in edits.get(name, {}).items():
            pattern = re.compile(rf"^{key}\s*=.*$", re.MULTILINE)
            line = f"{key} = {value}"
            text = pattern.sub(line, text) if pattern.search(text) else f"{line}\n{text}"
        config.write_text(text)
    return root


def oomy_workload() -> workloads.Workload:
    bodies = tuple(
        orjson.dumps(
            {
                "inputs": [
                    {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [i, 1.0, 2.0, 3.0]}
                ]
            }
        )
        for i in range(256)
    )
    return workloads.Workload("oomy", "oomy", 1, bodies, "oomy, one [1,4] row per request")


def served_run(
    label: str,
    repository: Path,
    workload: workloads.Workload,
    env: dict[str, str],
    duration_s: float,
    bodies_dir: Path,
) -> dict[str, Any]:
    bodies = workload.write_bodies(bodies_dir)
    with nograd_server(repository, None, env) as server:
        url = server.url + workload.path

        def closed(seconds: float) -> loadgen.LoadResult:
            return loadgen.run_closed(
                url,
                bodies,
                system="nograd",
                workload=workload.name,
                samples_per_request=1,
                connections=32,
                duration_s=seconds,
                cpus=None,
            )

        closed(1)  # warm-up, not counted
        before = scrape_metrics(server.url)
        result = closed(duration_s)
        after = scrape_metrics(server.url)
    model = workload.model

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    batches = delta("nograd_batch_size_count", model=model)
    largest = _max_bucket(before, after, model)
    return {
        "label": label,
        "env": env,
        "load": result.as_dict(),
        "batches": batches,
        "mean_batch_size": delta("nograd_batch_size_sum", model=model) / batches if batches else 0,
        "max_batch_at_most": None if math.isinf(largest) else largest,
        "batch_limit_end": metric(after, "nograd_batch_limit", model=model),
        "oom_total": metric(after, "nograd_oom_total", model=model),
        "batch_splits_total": metric(after, "nograd_batch_splits_total", model=model),
        "non_200": sum(
            value
            for (name, pairs), value in after.items()
            if name == "nograd_requests_total"
            and ("model", model) in pairs
            and dict(pairs).get("code") != "200"
        ),
        # By status code, over the whole server life (warm-up included): 499 is a request whose
        # client went away, which wrk does when it closes its connections at the end of a run.
        "codes": {
            dict(pairs).get("code", "?"): value
            for (name, pairs), value in after.items()
            if name == "nograd_requests_total" and ("model", model) in pairs
        },
    }


def _max_bucket(
    before: dict[tuple[str, tuple[tuple[str, str], ...]], float],
    after: dict[tuple[str, tuple[tuple[str, str], ...]], float],
    model: str,
) -> float:
    """The smallest histogram bound that holds every batch run during the measurement."""
    buckets = []
    for (name, pairs), value in after.items():
        if name == "nograd_batch_size_bucket" and ("model", model) in pairs:
            le = dict(pairs)["le"]
            bound = math.inf if le == "+Inf" else float(le)
            buckets.append((bound, value - before.get((name, pairs), 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0
    return next((bound for bound, count in buckets if count >= total), math.inf)


def served(duration_s: float, profiles: dict[str, Any], bodies_dir: Path) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    digits_repo = _temp_repository({"digits": ROOT / "models" / "digits"}, {})
    digits = workloads.make("digits")
    # Digits on eager: a budget that holds 4 samples and not 5.
    (fit,) = profiles["digits"]["eager"]["ranges"]
    small = int(fit["fixed_bytes"] + 4.5 * fit["per_unit_bytes"])
    try:
        runs.append(
            served_run("digits, default budget", digits_repo, digits, {}, duration_s, bodies_dir)
        )
        runs.append(
            served_run(
                f"digits, NOGRAD_MEMORY_BUDGET_BYTES={small} (limit 4)",
                digits_repo,
                digits,
                {"NOGRAD_MEMORY_BUDGET_BYTES": str(small)},
                duration_s,
                bodies_dir,
            )
        )
    finally:
        shutil.rmtree(digits_repo, ignore_errors=True)
    oomy = oomy_workload()
    budget_env = {"NOGRAD_MEMORY_BUDGET_BYTES": str(1024**2)}
    for cap, label in (
        (5, "memory-sized: max_batch_size 5"),
        (64, "fixed max_batch_size 64 (overruns)"),
    ):
        repo = _temp_repository({"oomy": OOMY}, {"oomy": {"max_batch_size": str(cap)}})
        try:
            runs.append(
                served_run(f"oomy, {label}", repo, oomy, budget_env, duration_s, bodies_dir)
            )
        finally:
            shutil.rmtree(repo, ignore_errors=True)
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per served run")
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help="engines to profile, comma-separated (aoti compiles for minutes on 2 cores)",
    )
    args = parser.parse_args(argv)
    profiles = profile_models(engines=tuple(args.engines.split(",")))
    result: dict[str, Any] = {"profiles": profiles}
    if not args.skip_served and loadgen.have_wrk():
        result["served"] = served(args.duration, profiles, args.out.parent / "bodies")
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


if __name__ == "__main__":
    main()
