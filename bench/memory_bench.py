"""Issue 3's benchmark: measured memory cost, derived batch limits, and serving under a budget.

Part A (in process, nograd's own code paths, as ``nograd/serving/dataplane.py`` calls them): for
each shipped
model, ``build_handler`` → ``profile_handler`` with a ``CpuMemoryProbe`` (live tensor bytes during
the forward) → the fitted cost model, its points and its check-point error; then ``plan_device``
with explicit budgets → the batch limit each budget gives, and the measured peak of a batch at
that limit (it must stay within the budget).

Part B (served by ``nograd`` under wrk, concurrency 32):
* digits with the default budget vs a small ``NOGRAD_MEMORY_BUDGET_BYTES`` whose limit is 4
  samples: throughput, latency, the batch sizes that actually ran (``nograd_batch_size``);
* the fault-injecting ``tests/fixtures/models/oomy`` model (raises ``torch.OutOfMemoryError`` for
  any batch above 5 rows: an out-of-memory on CPU without exhausting the machine) served with
  ``max_batch_size = 5`` (what a correct memory limit gives) vs ``max_batch_size = 64`` (a fixed
  cap that overruns it, as other servers are configured): throughput, errors (there should be
  none), ``nograd_oom_total``, ``nograd_batch_splits_total`` and the learned ``nograd_batch_limit``.

``python -m bench.memory_bench --out FILE [--duration S]``; ``bench.run`` calls it too.
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

BUDGETS = (64 * 1024, 256 * 1024, 1024**2, 16 * 1024**2, 256 * 1024**2, 1024**3)
OOMY = ROOT / "tests" / "fixtures" / "models" / "oomy"


def profile_models(names: tuple[str, ...] = ("digits", "minilm")) -> dict[str, Any]:
    from nograd.runtime.config import find_config, load_config
    from nograd.runtime.handler import TorchRunner
    from nograd.runtime.loader import build_handler, weights_bytes
    from nograd.runtime.memory import CpuMemoryProbe
    from nograd.runtime.planner import PlanInput, plan_device, profile_handler
    from nograd.settings import Settings

    repository = ROOT / "models"
    device = torch.device("cpu")
    probe = CpuMemoryProbe()
    default_cap = Settings().max_batch_size
    out: dict[str, Any] = {}
    for name in names:
        path = find_config(repository / name)
        assert path is not None
        config = load_config(path)
        handler = build_handler(repository, repository / name, config, device)
        tokens = config.batch_unit == "tokens"
        # The same cap as nograd.serving.loading.configured_limit.
        cap = (
            (config.max_batch_tokens or 16384) if tokens else (config.max_batch_size or default_cap)
        )
        profile = profile_handler(handler, probe, cap)
        cost = profile.model
        check = profile.check_point
        weights = weights_bytes(handler.module)
        entry: dict[str, Any] = {
            "unit": "token" if tokens else "sample",
            "cap": cap,
            "model_max_length": handler.max_length,
            "weights_bytes": weights,
            "points": [
                {
                    "rows": r,
                    "length": length,
                    "measured_bytes": b,
                    "predicted_bytes": cost.predict(r, length),
                }
                for r, length, b in profile.points
            ],
            "fixed_bytes": cost.fixed,
            "per_unit_bytes": cost.per_unit,
            "quadratic_bytes": cost.quadratic,
            "check": {
                "rows": check.rows,
                "length": check.length,
                "measured_bytes": check.measured_bytes,
                "predicted_bytes": check.predicted_bytes,
                "relative_error": check.relative_error,
            },
            "budgets": [],
        }
        runner = TorchRunner(handler)
        for budget in (*BUDGETS, None):
            spent, plans = plan_device(
                [PlanInput(name, handler, weights, cap)],
                {name: profile},
                probe,
                fraction=0.9,
                explicit_bytes=budget,
            )
            plan = plans[0]
            row: dict[str, Any] = {
                "budget_bytes": spent,
                "explicit": budget is not None,
                "limit": plan.limit,
                "unit": plan.unit,
                "reference_length": plan.reference_length,
            }
            if plan.limit >= 1 and budget is not None:
                # Measure a batch at the limit: it must fit the budget the limit came from.
                # Token models: the longest text the model reads (the planner's reference
                # length, or the model's own truncation length when that is shorter), as many
                # rows of it as the token limit allows.
                length = plan.reference_length if tokens else 1
                length = min(length, handler.max_length or length)
                rows = max(1, plan.limit // length) if tokens else plan.limit
                example = handler.example(rows, length)
                parts = [example.slice(i, i + 1) for i in range(rows)]
                peak = probe.measure_peak(functools.partial(runner.run_batch, parts))
                row.update(
                    {"measured_rows": rows, "measured_length": length, "measured_peak_bytes": peak}
                )
            entry["budgets"].append(row)
        out[name] = entry
    return out


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
    cost = profiles["digits"]
    small = int(cost["fixed_bytes"] + 4 * cost["per_unit_bytes"]) + 1
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
    args = parser.parse_args(argv)
    profiles = profile_models()
    result: dict[str, Any] = {"profiles": profiles}
    if not args.skip_served and loadgen.have_wrk():
        result["served"] = served(args.duration, profiles, args.out.parent / "bodies")
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


if __name__ == "__main__":
    main()
