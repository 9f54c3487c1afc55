"""The process's resident peak around a piece of work: what every allocator in it really used.

An engine with its own allocator (ONNX Runtime, an AOTInductor library, oneDNN's scratch
buffers) holds memory no torch counter sees; the resident set sees all of it. On Linux the
kernel keeps the resident high-water mark (``VmHWM`` in ``/proc/<pid>/status``) and resets it to
the current resident set when ``5`` is written to ``/proc/<pid>/clear_refs``; reset, run, read
gives the work's peak exactly, however short it was. Where the reset is refused (an old kernel,
a hardened ``/proc``) the resident set is sampled from a thread while the work runs instead,
which can miss a peak shorter than the sampling interval; where there is no ``/proc`` at all,
nothing can be measured and :class:`PeakUnavailable` says so.

The heap's free pages are handed back first, so memory a previous piece of work left free in
the heap is not silently reused and missed. This module imports no torch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

from nograd.host.heap import release_free_memory
from nograd.host.readings import status_bytes

logger = logging.getLogger(__name__)

SAMPLE_INTERVAL_S: Final = 0.0005
"""How often the fallback samples the resident set while the work runs."""
_RESET_PEAK: Final = "5"
"""What ``clear_refs`` takes to reset the resident high-water mark (Linux 4.0 and later)."""

T = TypeVar("T")


class PeakUnavailable(RuntimeError):
    """This system shows no resident memory of the process (no ``/proc``)."""


@dataclass(frozen=True)
class Peak:
    """Bytes the resident set rose by while the work ran, above where it started."""

    extra_bytes: int
    exact: bool
    """True when read from the kernel's high-water mark; False when sampled."""


class ResidentPeak:
    """Measures the resident peak of work run in this process (``pid`` for tests of others)."""

    def __init__(self, proc_root: Path | str = "/proc", pid: str = "self") -> None:
        self._process = Path(proc_root) / pid
        self._can_reset: bool | None = None

    def resident_bytes(self) -> int:
        return self._status("VmRSS")

    def high_water_bytes(self) -> int:
        return self._status("VmHWM")

    def reset(self) -> bool:
        """Set the high-water mark to the current resident set; False where it cannot be."""
        if self._can_reset is False:
            return False
        try:
            (self._process / "clear_refs").write_text(_RESET_PEAK)
        except OSError as exc:
            self._can_reset = False
            logger.warning(
                "cannot reset the resident high-water mark (%s: %s); memory peaks are sampled "
                "every %.1f ms instead and can miss shorter ones",
                self._process / "clear_refs",
                exc,
                SAMPLE_INTERVAL_S * 1e3,
            )
            return False
        self._can_reset = True
        return True

    def measure(self, work: Callable[[], T]) -> tuple[T, Peak]:
        """Run ``work``; its result and the resident peak it caused."""
        release_free_memory()
        if self.reset():
            start = self.resident_bytes()
            result = work()
            return result, Peak(max(0, self.high_water_bytes() - start), exact=True)
        return self._sampled(work)

    def _sampled(self, work: Callable[[], T]) -> tuple[T, Peak]:
        start = self.resident_bytes()
        with SampledPeak(self.resident_bytes, SAMPLE_INTERVAL_S) as sampled:
            result = work()
        return result, Peak(max(0, sampled.highest - start), exact=False)

    def _status(self, field: str) -> int:
        value = status_bytes(self._process / "status", field)
        if value is None:
            raise PeakUnavailable(f"{self._process / 'status'} shows no {field}")
        return value


class SampledPeak:
    """The highest of ``read()`` (resident bytes) sampled from a thread while the ``with``
    block runs: for work whose peak cannot be read from the high-water mark because other
    measurements inside it reset the mark. A peak shorter than ``interval_s`` can be missed."""

    def __init__(self, read: Callable[[], int], interval_s: float) -> None:
        self._read = read
        self._interval = interval_s
        self._done = threading.Event()
        self._sampler: threading.Thread | None = None
        self.highest = 0

    def _sample(self) -> None:
        self.highest = max(self.highest, self._read())

    def _run(self) -> None:
        while not self._done.wait(self._interval):
            self._sample()

    def __enter__(self) -> SampledPeak:
        self._sample()
        self._sampler = threading.Thread(target=self._run, name="nograd-peak-sampler", daemon=True)
        self._sampler.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        if self._sampler is not None:
            self._sampler.join()
        self._sample()
