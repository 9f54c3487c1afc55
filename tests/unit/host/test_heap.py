"""Free heap memory handed back to the OS: glibc's malloc_trim, and a no-op where there is none."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from nograd.host import heap

GLIBC = platform.libc_ver()[0] == "glibc"


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_glibc_releases() -> None:
    assert heap.can_release()
    assert heap.release_free_memory()


def test_no_malloc_trim_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    assert not heap.can_release()
    assert not heap.release_free_memory()


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_memory_freed_between_live_blocks_goes_back_to_the_os() -> None:
    """Blocks of 60 KB (below malloc's mmap threshold, so from the heap) with one in ten kept
    alive: free() alone keeps the holes resident; the release returns them."""
    heap.release_free_memory()
    blocks = [bytearray(60_000) for _ in range(4000)]  # 240 MB, every page touched
    kept = blocks[::10]
    del blocks
    held = rss_mib()
    assert heap.release_free_memory()
    released = held - rss_mib()
    assert released > 100, f"released {released:.0f} MiB of about 215 MiB freed"
    assert len(kept) == 400


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_one_arena_for_this_process_and_the_ones_it_starts() -> None:
    environ: dict[str, str] = {}
    assert heap.use_one_arena(environ)
    assert environ == {"MALLOC_ARENA_MAX": "1"}


def test_an_operators_arena_setting_is_kept() -> None:
    environ = {"MALLOC_ARENA_MAX": "4"}
    assert not heap.use_one_arena(environ)
    assert environ == {"MALLOC_ARENA_MAX": "4"}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_long_run_hands_the_heap_back_and_short_ones_once_an_interval() -> None:
    releases: list[float] = []
    clock = Clock()

    def release() -> bool:
        releases.append(clock.now)
        return True

    after = heap.AfterRuns(long_run_s=0.005, interval_s=1.0, release=release, clock=clock)
    # Short runs within the interval keep their freed memory for the next run.
    for _ in range(50):
        clock.now += 0.001
        assert not after.ran(0.0002)
    assert releases == []
    # A long run hands it back however recent the last release.
    assert after.ran(0.02)
    assert after.ran(0.005)
    assert len(releases) == 2
    # Short runs hand it back once the interval has passed since the last release.
    clock.now += 0.999
    assert not after.ran(0.0001)
    clock.now += 0.002
    assert after.ran(0.0001)
    assert not after.ran(0.0001)
    assert len(releases) == 3
