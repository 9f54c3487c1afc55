"""What one bench run measures and for how long, from its command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

LITSERVE_GRID = ((16, 0.005), (32, 0.005), (64, 0.005), (16, 0.01), (32, 0.01), (64, 0.01))
LITSERVE_QUICK = ((32, 0.005),)
PAIRED_RAW_BATCHES = "16,32,64"
"""The paired rounds time the raw minilm forward at these batch sizes only, to keep a round short;
its best lay in this range when every size was timed (BENCHMARKS.md)."""
PAIRED_ROUNDS = 3
"""Rounds of the paired phase: the median of three per-round ratios ignores one disturbed round."""

FLEET_SECONDS = 60.0
"""The fleet phase's seconds of clients per balance and round (issue 54's done-when)."""
FLEET_ROUNDS = 2
"""The fleet phase's rounds: model-aware balancing and round robin, the order alternating."""


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
    base_revision: str | None = None  # the revisions phase's base (``--base``)
    revision_workers: str = "1"  # NOGRAD_WORKERS of both servers in the revisions phase
    revision_workloads: tuple[str, ...] = ("digits", "minilm-1", "mnist-png")
    process_workers: str = "2"  # NOGRAD_WORKERS of the processes phase's workers system
    process_fronts: str = "auto"  # NOGRAD_FRONTS of its engine system (auto: as make run)
    process_starts: int = 1  # cold and warm starts of each system, timed alone
    fleet_seconds: float = FLEET_SECONDS  # the fleet phase: clients' seconds per balance
    fleet_rounds: int = FLEET_ROUNDS  # the fleet phase: paired rounds of both balances
    residency_s: float = 60.0  # the residency phase's one-server Zipf run

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
            base_revision=getattr(args, "base", None),
            revision_workers=getattr(args, "revision_workers", "1"),
            revision_workloads=tuple(
                getattr(args, "revision_workloads", "digits,minilm-1,mnist-png").split(",")
            ),
            process_workers=getattr(args, "process_workers", "2"),
            process_fronts=getattr(args, "process_fronts", "auto"),
            process_starts=getattr(args, "process_starts", 1),
            fleet_seconds=getattr(args, "fleet_seconds", None)
            or (15.0 if quick else FLEET_SECONDS),
            fleet_rounds=getattr(args, "fleet_rounds", None) or (1 if quick else FLEET_ROUNDS),
            residency_s=getattr(args, "residency_seconds", None) or (10.0 if quick else 60.0),
        )
