"""How many worker processes ``auto`` plans, the memory check for one more, and when ``auto``
plans one engine and fronts instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from nograd.settings import Settings
from nograd.supervisor.plan import (
    AUTO_FRONTS,
    AUTO_MAX_GPU_FRONTS,
    AUTO_MAX_WORKERS,
    AUTO_MEMORY_SHARE,
    another_fits,
    auto_fronts,
    auto_workers,
    resolve_fronts,
    resolve_workers,
    sequence_models,
)


@pytest.mark.parametrize(
    ("cores", "gpu", "threads", "expected"),
    [
        (1, False, None, 1),
        (2, False, None, 2),
        (16, False, None, AUTO_MAX_WORKERS),
        (16, True, None, 1),
        (1, True, None, 1),
        # A fixed thread count per worker: no more workers than the cores hold at that count.
        (2, False, 2, 1),
        (2, False, 1, 2),
        (4, False, 3, 1),
        (8, False, 4, 2),
    ],
)
def test_auto_plans_two_workers_on_a_cpu_machine_with_two_cores_or_more(
    cores: int, gpu: bool, threads: int | None, expected: int
) -> None:
    count, reason = auto_workers(cores, gpu, threads)
    assert count == expected
    assert ("GPU is visible" in reason) is gpu


def test_a_worker_count_given_is_kept_and_auto_is_resolved_to_a_count() -> None:
    assert resolve_workers(Settings(workers=3)) == (Settings(workers=3), False)
    settings, planned = resolve_workers(Settings(workers="auto"))
    assert planned
    assert isinstance(settings.workers, int) and 1 <= settings.workers <= AUTO_MAX_WORKERS


def test_another_worker_fits_only_within_the_share_of_available_memory() -> None:
    assert another_fits(800, 1000) is (AUTO_MEMORY_SHARE * 1000 >= 800)
    assert another_fits(801, 1000) is False
    assert another_fits(None, 0)  # an unreadable footprint does not stop a start


def test_auto_plans_one_worker_for_a_repository_with_a_sequence_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker keeps its own sequences, and a sequence's requests may reach any worker."""
    monkeypatch.setattr("nograd.supervisor.plan.auto_plan", lambda threads: (2, "2 cores"))
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.pbtxt").write_text('name: "plain"\n# sequence_batching\n')
    settings, _ = resolve_workers(Settings(workers="auto", model_repository=tmp_path))
    assert settings.workers == 2 and sequence_models(tmp_path) == []
    (tmp_path / "seq").mkdir()
    (tmp_path / "seq" / "config.pbtxt").write_text("max_batch_size: 8\nsequence_batching {\n}\n")
    settings, planned = resolve_workers(Settings(workers="auto", model_repository=tmp_path))
    assert (settings.workers, planned) == (1, True)
    assert sequence_models(tmp_path) == ["seq"]


@pytest.mark.parametrize(
    ("cores", "gpu", "on_demand", "expected"),
    [
        # Without a GPU: one engine (each model loaded once) and two fronts on 2 cores or more.
        (2, False, False, AUTO_FRONTS),
        (16, False, False, AUTO_FRONTS),
        (1, False, False, 0),
        (2, False, True, AUTO_FRONTS),
        (16, False, True, AUTO_FRONTS),
        (1, False, True, 0),
        # A GPU: one engine (one CUDA context, the whole device) fed by fronts on half the cores.
        (16, True, False, 8),
        (64, True, True, AUTO_MAX_GPU_FRONTS),
        (4, True, False, AUTO_FRONTS),
        (1, True, False, 0),
    ],
)
def test_auto_plans_an_engine_and_fronts_on_two_cores_or_more(
    cores: int, gpu: bool, on_demand: bool, expected: int
) -> None:
    count, reason = auto_fronts(cores, gpu, on_demand)
    assert count == expected
    assert (reason is None) is (expected == 0)


def test_auto_plans_an_engine_and_fronts_for_a_repository_with_a_sequence_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One engine keeps every sequence whatever front a request came through: two fronts, where
    workers would drop to one serving every call."""
    monkeypatch.setattr("nograd.supervisor.plan.usable_cores", lambda: 2)
    monkeypatch.setattr("nograd.supervisor.plan.gpu_visible", lambda: False)
    (tmp_path / "seq").mkdir()
    (tmp_path / "seq" / "config.pbtxt").write_text("max_batch_size: 8\nsequence_batching {\n}\n")
    resolved = resolve_fronts(Settings(model_repository=tmp_path))
    assert (resolved.fronts, resolved.workers) == (AUTO_FRONTS, 1)
    count, reason = auto_fronts(2, False, False, "seq")
    assert count == AUTO_FRONTS and reason is not None and "'seq'" in reason
    assert auto_fronts(1, False, False, "seq") == (0, None)  # one core: one process
    # Chosen workers stay workers (one, as the sequence model allows).
    assert resolve_fronts(Settings(model_repository=tmp_path, workers=1)).fronts == 0


def test_fronts_auto_resolves_only_beside_workers_auto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("nograd.supervisor.plan.usable_cores", lambda: 2)
    monkeypatch.setattr("nograd.supervisor.plan.gpu_visible", lambda: False)
    on_demand = Settings(model_repository=tmp_path, model_control="on_demand")
    resolved = resolve_fronts(on_demand)
    assert (resolved.fronts, resolved.workers) == (AUTO_FRONTS, 1)
    # An explicit worker count is a choice of workers; an explicit front count is kept.
    assert resolve_fronts(on_demand.model_copy(update={"workers": 2})).fronts == 0
    assert resolve_fronts(on_demand.model_copy(update={"fronts": 3})).fronts == 3
    resolved = resolve_fronts(Settings(model_repository=tmp_path))
    assert (resolved.fronts, resolved.workers) == (AUTO_FRONTS, 1)  # the defaults
    assert resolve_fronts(Settings(model_repository=tmp_path, fronts=0)).workers == "auto"
    assert resolve_fronts(on_demand.model_copy(update={"port": 0})).fronts == 0  # gRPC only
    assert Settings().front_count == 0  # an app built in-process serves in its own process
