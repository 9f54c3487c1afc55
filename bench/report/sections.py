"""Report sections: LitServe's sweep, the raw forward, batching on and off."""

from __future__ import annotations

from typing import Any

from bench.report.common import (
    fmt,
    head,
    ratio,
    table,
)


def sweep_section(sweep: list[dict[str, Any]], title: str) -> list[str]:
    if not sweep:
        return []
    header = ("workload", "max_batch_size", "batch_timeout s", "req/s", "samples/s", "p99 ms")
    rows = [
        (
            s["workload"],
            s["max_batch_size"],
            str(s["batch_timeout"]),
            s["rps"],
            s["samples_per_s"],
            s["p99_ms"],
            s["errors"],
        )
        for s in sweep
    ]
    return [f"## {title}", "", table((*header, "errors"), rows), ""]


def workloads_model(workload: str) -> str:
    return "digits" if workload == "digits" else "minilm"


def raw_section(results: dict[str, Any], tag: str) -> list[str]:
    raw = results.get("raw")
    if not raw:
        return []
    out = [
        f"## Raw model, no HTTP ({tag}, {raw.get('torch_threads')} torch threads)",
        "",
        f"Other processes used {fmt(raw.get('foreign_cpu_cores'), 2)} cores during this "
        f"measurement (attempt {raw.get('attempt', 1)}).",
        "",
    ]
    for model in ("digits", "minilm"):
        data = raw.get(model)
        if not data:
            continue
        header: tuple[str, ...] = ("batch", "samples/s", "ms per batch")
        rows: list[tuple[Any, ...]] = [
            (r["batch"], r["samples_per_s"], r["ms_per_batch"]) for r in data["rows"]
        ]
        if model == "minilm":
            header = (*header, "samples/s incl. tokenisation", "nograd's packed forward samples/s")
            rows = [
                (*row, r["samples_per_s_with_tokenize"], r.get("packed_samples_per_s"))
                for row, r in zip(rows, data["rows"], strict=True)
            ]
        out += [f"### {model}", "", table(header, rows), ""]
        out.append(
            f"Best: batch {data['best']['batch']}, {fmt(data['best']['samples_per_s'])} samples/s."
        )
        if model == "minilm":
            out.append(f" Batch-1 forward p50 {fmt(data['batch1_p50_ms'], 2)} ms.")
            packed = data.get("packed_best")
            if packed:
                out.append(
                    f" nograd's packed forward (the same weights, padding skipped): best batch "
                    f"{packed['batch']}, {fmt(packed['samples_per_s'])} samples/s; batch-1 p50 "
                    f"{fmt(data.get('packed_batch1_p50_ms'), 2)} ms. The targets use the model as "
                    "transformers runs it (the baselines' forward); the stricter rows use this."
                )
        out.append("")
    return out


def batching_section(results: dict[str, Any], tag: str) -> list[str]:
    rows = []
    for workload in results["meta"]["plan"]["workloads"]:
        on = head(results, "nograd", workload)
        off = head(results, "nograd-batching-off", workload)
        if on and off:
            rows.append(
                (
                    workload,
                    on["samples_per_s"],
                    on["extra"].get("mean_batch_size"),
                    on["p99_ms"],
                    off["samples_per_s"],
                    off["extra"].get("mean_batch_size"),
                    off["p99_ms"],
                    ratio(on["samples_per_s"], off["samples_per_s"]),
                )
            )
    if not rows:
        return []
    return [
        f"## Batching on vs off, nograd ({tag}, c={results['meta']['plan']['concurrency']})",
        "",
        "Off: digits `max_batch_size = 1`; minilm `max_batch_tokens` = the longest tokenised "
        "text of the workload (minilm has no row cap, so two short texts can still share a "
        "batch: the measured mean batch size shows how often).",
        "",
        table(
            (
                "workload",
                "on samples/s",
                "on mean batch",
                "on p99 ms",
                "off samples/s",
                "off mean batch",
                "off p99 ms",
                "on/off",
            ),
            rows,
        ),
        "",
    ]
