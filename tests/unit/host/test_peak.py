"""The process's resident peak around a piece of work: exact where the kernel's high-water mark
can be reset, sampled where it cannot, refused where there is no /proc."""

from __future__ import annotations

import logging
import multiprocessing
import platform
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from nograd.host.peak import Peak, PeakUnavailable, ResidentPeak

LINUX = platform.system() == "Linux"
MIB = 1 << 20


def touch(size: int) -> bytearray:
    """``size`` bytes, every page written (a page only counts once it is touched)."""
    block = bytearray(size)
    for offset in range(0, size, 4096):
        block[offset] = 1
    return block


def in_fresh_process(measurement: Callable[[], Peak]) -> Peak:
    """``measurement`` run in a process of its own: the high-water mark is the whole process's,
    and a thread another test left running in this one (a memory profile on a device thread)
    may reset it or allocate meanwhile."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measurement).result(timeout=60)


def short_allocation() -> Peak:
    def work() -> int:
        block = touch(32 * MIB)
        return len(block)  # freed here: only the high-water mark remembers it

    result, peak = ResidentPeak().measure(work)
    assert result == 32 * MIB
    return peak


def work_beside_held_memory() -> Peak:
    held = touch(64 * MIB)
    _, peak = ResidentPeak().measure(lambda: touch(4 * MIB))
    del held
    return peak


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_a_short_allocation_freed_before_the_reading_still_counts() -> None:
    peak = in_fresh_process(short_allocation)
    assert peak.exact
    assert 30 * MIB <= peak.extra_bytes <= 40 * MIB


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_memory_held_before_the_work_is_not_billed_to_it() -> None:
    peak = in_fresh_process(work_beside_held_memory)
    assert 3 * MIB <= peak.extra_bytes <= 8 * MIB


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_where_the_mark_cannot_be_reset_the_resident_set_is_sampled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # This process's status, seen through a folder whose clear_refs is not writable.
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "status").symlink_to("/proc/self/status")
    (proc / "self" / "clear_refs").mkdir()  # writing a folder fails like a refused reset
    peaks = ResidentPeak(proc)
    with caplog.at_level(logging.WARNING, logger="nograd.host.peak"):

        def work() -> None:
            block = touch(48 * MIB)
            time.sleep(0.05)  # long enough for the sampler to see it
            del block

        _, peak = peaks.measure(work)
    assert not peak.exact
    assert peak.extra_bytes >= 40 * MIB
    assert "cannot reset the resident high-water mark" in caplog.text
    # Refused once, never tried again, and said once.
    peaks.measure(lambda: None)
    assert caplog.text.count("cannot reset") == 1


def test_without_proc_nothing_is_measured(tmp_path: Path) -> None:
    with pytest.raises(PeakUnavailable, match="VmRSS"):
        ResidentPeak(tmp_path).measure(lambda: None)
