"""The latency-vs-throughput plot (PNG), log-log, one panel per workload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report.common import (
    COLORS,
    LABELS,
    runs,
)
from bench.report.sections import workloads_model
from bench.report.targets import raw_limit


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = results["meta"]
    names = list(meta["plan"]["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(6.2 * len(names), 4.8), squeeze=False)
    for ax, workload in zip(axes[0], names, strict=True):
        for system, color in COLORS.items():
            closed = sorted(
                (
                    r
                    for r in runs(results, system=system, workload=workload, mode="closed")
                    if r["requests"] > 0
                ),
                key=lambda r: r["concurrency"],
            )
            if closed:
                x = [r["samples_per_s"] for r in closed]
                ax.plot(
                    x,
                    [r["p99_ms"] for r in closed],
                    "-o",
                    color=color,
                    label=f"{LABELS[system]} p99",
                )
                ax.plot(x, [r["p50_ms"] for r in closed], ":", marker=".", color=color, alpha=0.7)
                for r in closed:
                    ax.annotate(
                        f"c{r['concurrency']}",
                        (r["samples_per_s"], r["p99_ms"]),
                        fontsize=7,
                        color=color,
                    )
            opened = [
                r
                for r in runs(results, system=system, workload=workload, mode="open")
                if r["requests"] > 0
            ]
            if opened:
                ax.scatter(
                    [r["samples_per_s"] for r in opened],
                    [max(r["p99_ms"], 1e-3) if r["p99_ms"] == r["p99_ms"] else 1e4 for r in opened],
                    marker="x",
                    s=50,
                    color=color,
                )
        limit = raw_limit(results, workloads_model(workload))
        if limit:
            ax.axvline(limit, ls="--", color="black", lw=1, label="raw model best")
        ax.set_yscale("log")
        ax.set_xscale("log")
        ax.set_xlabel("throughput (samples/s, log)")
        ax.set_ylabel("latency (ms): p99 solid, p50 dotted, open loop ×")
        ax.set_title(f"{workload} ({meta['cores']} cores)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"nograd vs alternatives: latency vs throughput, {meta['started']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
