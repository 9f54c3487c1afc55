"""Report section: where the time goes (py-spy and torch.profiler)."""

from __future__ import annotations

from typing import Any

from bench.report.common import (
    fmt,
    table,
)


def profile_section(results: dict[str, Any], tag: str) -> list[str]:
    out: list[str] = []
    if results.get("pyspy") or results.get("torch_profile"):
        out += ["## Where the time goes (py-spy and torch.profiler)", ""]
    spy = results.get("pyspy", {})
    for workload, s in spy.items():
        if "error" in s:
            out += [f"py-spy on {workload}: {s['error']}", ""]
            continue
        load = s["load"]
        server_cpu = load["extra"].get("server_cpu_cores", 0) * load["duration_s"]
        out += [
            f"### Where the time goes: nograd, {workload}, c={load['concurrency']} "
            f"({tag}, py-spy {s['rate_hz']} Hz)",
            "",
            f"{load['requests']} requests at {fmt(load['rps'])} req/s while sampled. py-spy "
            f"counted {fmt(s['sampled_thread_s'], 1)} s of busy Python-thread time "
            f"({fmt(s['thread_us_per_request'])} µs per request; samples of threads parked on a "
            f"queue, {s['idle_samples']}, left out); the server process used "
            f"{fmt(server_cpu, 1)} CPU s in all, torch's native intra-op threads included, "
            "which py-spy does not see.",
            "",
            table(
                ("category", "share of busy samples", "thread µs per request"),
                [
                    (c["name"], f"{100 * c['share']:.1f}%", c["thread_us_per_request"])
                    for c in s["categories"]
                ],
            ),
            "",
            "Threads: " + ", ".join(f"{t['name']} {100 * t['share']:.0f}%" for t in s["threads"]),
            "",
            "Top self frames: "
            + "; ".join(f"`{t['name']}` {100 * t['share']:.1f}%" for t in s["top_frames"][:8]),
            "",
        ]
    prof = results.get("torch_profile")
    if prof:
        rows = []
        for model in ("digits", "minilm"):
            e = prof.get(model)
            if not e:
                continue
            phase = e.get("phase_ms", {})
            rows.append(
                (
                    model,
                    e["batch"],
                    e.get("v2_decode_us"),
                    e.get("prepare_us"),
                    phase.get("collate"),
                    phase.get("forward"),
                    phase.get("to_numpy"),
                    e.get("v2_encode_us"),
                )
            )
        out += [
            f"### nograd's own code paths in isolation ({tag}, "
            f"{prof.get('torch_threads')} torch threads)",
            "",
            "Per request: V2 JSON decode of one body, `prepare` (minilm: tokenisation), V2 JSON "
            "encode of one answer. Per batch (at nograd's mean batch size under c=32 load): "
            "collate, forward, to_numpy.",
            "",
            table(
                (
                    "model",
                    "batch",
                    "decode µs/req",
                    "prepare µs/req",
                    "collate ms",
                    "forward ms",
                    "to_numpy ms",
                    "encode µs/req",
                ),
                rows,
            ),
            "",
        ]
        for model in ("digits", "minilm"):
            e = prof.get(model)
            if e and e.get("top_ops"):
                out += [
                    f"torch.profiler top ops, {model} batch {e['batch']}: "
                    + ", ".join(
                        f"`{o['op']}` {100 * o['self_cpu_share']:.0f}%" for o in e["top_ops"][:6]
                    ),
                    "",
                ]
    return out
