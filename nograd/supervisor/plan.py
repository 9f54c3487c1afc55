"""How many worker processes to start: ``NOGRAD_WORKERS=auto`` resolved from the host."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from nograd.host.readings import gpu_visible, usable_cores
from nograd.settings import Settings

logger = logging.getLogger(__name__)

AUTO_MAX_WORKERS = 2
"""``auto`` starts at most this many: a second process lets a small model use the second core
its GIL-bound first one leaves idle; past that every copy costs memory for a gain not shown
(docs/architecture.md), so more is an explicit choice."""
AUTO_MEMORY_SHARE = 0.8
"""``auto`` starts another worker only if the first one's resident memory fits in this share
of the memory still available (the rest is left for the batches and the page cache)."""


def auto_workers(cores: int, gpu: bool, torch_threads: int | None = None) -> tuple[int, str]:
    """How many workers ``NOGRAD_WORKERS=auto`` plans, and why (for the start-up log).

    A fixed ``NOGRAD_TORCH_THREADS`` is every worker's count: workers are then limited to as
    many as the cores hold at that count, so torch's threads never outnumber the cores.
    """
    if gpu:
        # Each worker would hold a CUDA context and a copy of the weights on the same device.
        return 1, "a GPU is visible"
    plural = "s" if cores != 1 else ""
    reason = f"{cores} usable CPU core{plural}, no GPU"
    room = cores
    if torch_threads is not None:
        room = cores // torch_threads
        reason += f", NOGRAD_TORCH_THREADS={torch_threads} per worker"
    return max(1, min(room, AUTO_MAX_WORKERS)), reason


def auto_plan(torch_threads: int | None = None) -> tuple[int, str]:
    """``auto_workers`` for this process: its usable cores and the GPUs it can see."""
    return auto_workers(usable_cores(), gpu_visible(), torch_threads)


AUTO_FRONTS = 2
"""Front processes ``fronts = auto`` starts beside the engine on a CPU-only host."""
AUTO_MAX_GPU_FRONTS = 8
"""Front processes ``fronts = auto`` starts at most beside an engine that feeds a GPU."""


def auto_fronts(
    cores: int, gpu: bool, on_demand: bool, sequence: str | None = None
) -> tuple[int, str | None]:
    """How many fronts ``fronts = auto`` plans beside an engine (0: one worker), and why. One
    engine loads each model once, keeps residency and sequences whole-server and starts in a
    fraction of the workers' time, while the fronts decode on the other cores. With a GPU
    visible it also keeps one CUDA context and the device's whole memory, and the fronts take
    half the cores (one worker alone left the others idle and set the pace). One usable core
    leaves no room for a second process."""
    if cores < 2:
        return 0, None
    if gpu:
        count = min(max(cores // 2, AUTO_FRONTS), AUTO_MAX_GPU_FRONTS)
        return count, f"a GPU is visible, {cores} usable CPU cores"
    reason = f"{cores} usable CPU cores, no GPU"
    if on_demand:
        reason += ", model_control = on_demand"
    if sequence is not None:
        reason += f", sequence model {sequence!r} (sequence_batching) in the repository"
    return AUTO_FRONTS, reason


def resolve_fronts(settings: Settings) -> Settings:
    """``settings`` with ``fronts`` a number. ``auto`` plans fronts only while ``workers`` is
    ``auto`` too (an explicit worker count is a choice of workers) and HTTP is on (fronts serve
    HTTP)."""
    if settings.fronts != "auto":
        return settings
    count, reason = 0, None
    if settings.workers == "auto" and settings.port:
        sequences = sequence_models(settings.model_repository)
        count, reason = auto_fronts(
            usable_cores(),
            gpu_visible(),
            settings.model_control == "on_demand",
            sequences[0] if sequences else None,
        )
    if reason is not None:
        logger.info("fronts: auto, one engine process and %d fronts (%s)", count, reason)
    update: dict[str, object] = {"fronts": count}
    if count:
        update["workers"] = 1
    return settings.model_copy(update=update)


def resolve_workers(settings: Settings) -> tuple[Settings, bool]:
    """``settings`` with ``workers`` a number, and whether it was planned by ``auto`` (then
    workers after the first are started only while another copy of the models fits)."""
    if settings.workers != "auto":
        return settings, False
    count, reason = auto_plan(settings.torch_threads)
    sequences = sequence_models(settings.model_repository)
    if sequences and count > 1:
        # Each worker keeps its own sequences, and a sequence's connections may reach any.
        count, reason = 1, f"sequence model {sequences[0]!r} (sequence_batching) in the repository"
    logger.info("workers: auto, %d (%s)", count, reason)
    return settings.model_copy(update={"workers": count}), True


SEQUENCE_BATCHING = re.compile(r"^\s*sequence_batching\b", re.MULTILINE)


def sequence_models(repository: Path) -> list[str]:
    """The Triton models of ``repository`` whose ``config.pbtxt`` declares
    ``sequence_batching``, by name; an unreadable file counts as none."""
    found = []
    for config in sorted(repository.glob("*/config.pbtxt")):
        try:
            text = config.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if SEQUENCE_BATCHING.search(text):
            found.append(config.parent.name)
    return found


def another_fits(footprint: int | None, available: int, started: int = 1) -> bool:
    """Whether one more copy of a worker holding ``footprint`` resident bytes fits in
    ``available``; an unreadable footprint does not stop a start. When it does not, the log says
    why the server goes on with the ``started`` workers it has."""
    if footprint is None or footprint <= AUTO_MEMORY_SHARE * available:
        return True
    logger.warning(
        "workers: auto, serving with %d: another worker would hold %s more (the first one's "
        "resident memory) and %s is available, of which %.0f%% may go to it; set "
        "NOGRAD_WORKERS to choose",
        started,
        gigabytes(footprint),
        gigabytes(available),
        AUTO_MEMORY_SHARE * 100,
    )
    return False


def gigabytes(value: int | None) -> str:
    return "?" if value is None else f"{value / 1e9:.2f} GB"
