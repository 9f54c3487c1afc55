"""Report section: speed modes on the raw forward."""

from __future__ import annotations

from typing import Any

from bench.report.common import (
    fmt,
    ratio,
    table,
)


def levers_section(results: dict[str, Any], tag: str) -> list[str]:
    out: list[str] = []
    levers = results.get("levers")
    if levers:
        out += [
            f"## Speed levers, raw forward ({tag}, {levers.get('torch_threads')} torch threads)",
            "",
            f"Other processes used {fmt(levers.get('foreign_cpu_cores'), 2)} cores meanwhile.",
            "",
        ]
        rows: list[tuple[Any, ...]] = []
        for model, entries in levers.get("grad_modes", {}).items():
            for e in entries:
                rows.append(
                    (
                        model,
                        e["batch"],
                        e["inference_mode"],
                        e["no_grad"],
                        e["grad_enabled"],
                        ratio(e["inference_mode"], e["no_grad"]),
                    )
                )
        out += [
            "### Autograd mode (samples/s)",
            "",
            table(
                (
                    "model",
                    "batch",
                    "inference_mode",
                    "no_grad",
                    "grad enabled",
                    "inference_mode / no_grad",
                ),
                rows,
            ),
            "",
        ]
        rows = []
        for model, entry in levers.get("precision", {}).items():
            fp32 = entry["fp32"]
            for key, label in (
                ("bf16_cast", "bf16 (weights cast)"),
                ("bf16_autocast", "bf16 autocast"),
            ):
                e = entry[key]
                for batch_key in fp32:
                    rows.append(
                        (
                            model,
                            label,
                            batch_key.removeprefix("batch"),
                            fp32[batch_key],
                            e[batch_key],
                            ratio(e[batch_key], fp32[batch_key]),
                            f"{e['max_abs_error']:.2e}",
                            f"{e['min_cosine']:.6f}",
                        )
                    )
        out += [
            "### bf16 vs fp32 (samples/s; accuracy vs fp32 on held-out inputs)",
            "",
            table(
                (
                    "model",
                    "mode",
                    "batch",
                    "fp32",
                    "bf16",
                    "bf16/fp32",
                    "max abs error",
                    "min cosine",
                ),
                rows,
            ),
            "",
        ]
        threads = levers.get("threads", {}).get("rows", [])
        if threads:
            index = {
                (r["model"], r["batch"], r["threads"], r["busy_neighbour"]): r["samples_per_s"]
                for r in threads
            }
            rows = []
            for model, batch in sorted({(r["model"], r["batch"]) for r in threads}):
                rows.append(
                    (
                        model,
                        batch,
                        index.get((model, batch, 1, False)),
                        index.get((model, batch, 2, False)),
                        index.get((model, batch, 1, True)),
                        index.get((model, batch, 2, True)),
                    )
                )
            out += [
                "### torch intra-op threads, alone and beside one busy process (samples/s)",
                "",
                "The busy process (a spinning child) stands for anything else wanting a core, "
                "such as the server's own event loop.",
                "",
                table(
                    (
                        "model",
                        "batch",
                        "1 thread",
                        "2 threads",
                        "1 thread + busy neighbour",
                        "2 threads + busy neighbour",
                    ),
                    rows,
                ),
                "",
            ]
        agree = levers.get("precision", {}).get("digits", {}).get("label_agreement_bf16_cast")
        if agree is not None:
            out += [
                f"digits: bf16 (cast) predicts the same label as fp32 for {agree:.1%} of 512 "
                "held-out images.",
                "",
            ]
    comp = results.get("compile")
    if comp:
        out += [f"### torch.compile vs eager ({tag})", ""]
        if "compile" not in comp:
            out += [f"Skipped: {comp.get('skipped', 'not run')}.", ""]
        else:
            rows = []
            for model, e in comp["compile"].items():
                if "error" in e:
                    rows.append((model, "–", "–", "–", "–", "failed: " + e["error"][:120]))
                    continue
                for b in (1, 64 if model == "digits" else 32):
                    speedup = ratio(e.get(f"compiled_batch{b}"), e.get(f"eager_batch{b}"))
                    rows.append(
                        (
                            model,
                            b,
                            e.get(f"compile_s_batch{b}"),
                            e.get(f"eager_batch{b}"),
                            e.get(f"compiled_batch{b}"),
                            f"×{fmt(speedup, 2)}"
                            f", max abs err {e.get(f'max_abs_error_batch{b}', 0):.1e} "
                            f"({e.get('shapes')})",
                        )
                    )
            out += [
                table(
                    (
                        "model",
                        "batch",
                        "compile s (first call)",
                        "eager samples/s",
                        "compiled samples/s",
                        "notes",
                    ),
                    rows,
                ),
                "",
                "Inductor's on-disk cache was "
                f"{'warm (earlier runs)' if comp.get('inductor_cache_warm') else 'cold'}; "
                "a cold compile takes longer.",
                "",
            ]
    return out
