"""The machine as a process inside a container sees it: memory, CPU cores, GPUs.

Read from /proc, the cgroup files and /dev, never from torch: the worker supervisor decides how
many server processes to start from these before any of them imports torch, and the runtime
budgets memory and threads from the same readings. Paths are injectable for tests.
"""

from __future__ import annotations

import math
import os
import resource
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Final

_CGROUP_UNLIMITED: Final = 1 << 60
"""cgroup v1's "no limit" (a huge number), and a sane upper bound for anything larger."""


def _page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 4096


def cgroup_dirs(
    controller: str, proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> list[Path]:
    """The process's own cgroup directory (when visible) and the mount root.

    With a cgroup namespace the root *is* the container's group; without one the own group sits
    below the root under the path listed in /proc/self/cgroup. ``controller`` is "" for cgroup
    v2 and the v1 controller's name (``memory``, ``cpu``) otherwise.
    """
    dirs: list[Path] = []
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") and path not in ("", "/"):
            dirs.append(cgroup_root / (controller or ".") / path.lstrip("/"))
    dirs.append(cgroup_root / (controller or "."))
    return dirs


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _CGROUP_UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _field(path: Path, field: str, separator: str = ":") -> int | None:
    """A numeric ``name<separator> value [kB]`` line of a /proc or cgroup file (``kB``: in
    bytes): /proc/meminfo and /proc/<pid>/status with ":", memory.stat with " "."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(separator)
        parts = rest.split()
        if name == field and parts and parts[0].isdigit():
            return int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return None


class HostMemory:
    """The host's memory as a process inside a container may use it.

    Capacity honours the container's cgroup memory limit as well as ``/proc/meminfo``: inside
    Kubernetes/Docker, MemTotal reports the *host*, and budgeting from it is how a server gets
    OOM-killed.  Paths are injectable so the parsing can be tested without a container.
    """

    def __init__(
        self,
        proc_root: Path | str = "/proc",
        cgroup_root: Path | str = "/sys/fs/cgroup",
    ) -> None:
        self._proc = Path(proc_root)
        self._cgroup = Path(cgroup_root)

    def total_bytes(self) -> int:
        total = self._meminfo("MemTotal")
        if total is None:
            total = self._sysconf_bytes("SC_PHYS_PAGES")
        limit = self._cgroup_limit()
        return total if limit is None else min(total, limit[0])

    def available_bytes(self) -> int:
        available = self._meminfo("MemAvailable")
        if available is None:
            available = self._sysconf_bytes("SC_AVPHYS_PAGES")
        limit = self._cgroup_limit()
        if limit is None:
            return available
        return max(0, min(available, limit[1]))

    def allocated_bytes(self) -> int:
        """This process's resident memory: what a CPU device has allocated."""
        try:
            fields = (self._proc / "self" / "statm").read_text().split()
            return int(fields[1]) * _page_size()
        except (OSError, IndexError, ValueError):
            return 0

    @staticmethod
    def peak_allocated_bytes() -> int:
        """This process's peak resident memory since it started."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # Linux reports KiB, macOS bytes.
        return int(peak) if sys.platform == "darwin" else int(peak) * 1024

    def _meminfo(self, field: str) -> int | None:
        return _field(self._proc / "meminfo", field)

    @staticmethod
    def _sysconf_bytes(name: str) -> int:
        try:
            return os.sysconf(name) * _page_size()
        except (AttributeError, ValueError, OSError):
            return 0

    def _cgroup_dirs(self, controller: str) -> list[Path]:
        return cgroup_dirs(controller, self._proc, self._cgroup)

    def _cgroup_limit(self) -> tuple[int, int] | None:
        """(smallest limit, smallest headroom) among the visible memory cgroups, if any."""
        candidates: list[tuple[int, int]] = []
        v2 = [
            (d / "memory.max", d / "memory.current", d / "memory.stat", "inactive_file")
            for d in self._cgroup_dirs("")
        ]
        v1 = [
            (
                d / "memory.limit_in_bytes",
                d / "memory.usage_in_bytes",
                d / "memory.stat",
                "total_inactive_file",
            )
            for d in self._cgroup_dirs("memory")
        ]
        for limit_path, usage_path, stat_path, reclaimable in v2 + v1:
            limit = _read_int(limit_path)
            if limit is None or limit >= _CGROUP_UNLIMITED:
                continue
            usage = _read_int(usage_path) or 0
            # Inactive page cache is reclaimed before the OOM killer fires, so it is not
            # really "used" (the same working-set definition the kubelet uses).
            usage -= _field(stat_path, reclaimable, " ") or 0
            candidates.append((limit, limit - max(0, usage)))
        if not candidates:
            return None
        return min(c[0] for c in candidates), min(c[1] for c in candidates)


def usable_cores(
    proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup CPU quota (v2 or v1).

    A container limited to 2 CPUs on a 64-core node still sees 64 cores; torch threads beyond
    the quota only get the whole process throttled by the kernel. The quota is looked up in the
    same cgroup directories the memory probe reads its limit from.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    for quota in _cpu_quotas(proc_root, cgroup_root):
        cores = min(cores, max(1, math.ceil(quota)))
    return cores


def _cpu_quotas(proc_root: Path, cgroup_root: Path) -> list[float]:
    """Every CPU quota (in cores) visible to the process: cgroup v2 ``cpu.max``, and cgroup v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (still what older nodes and runtimes give)."""
    quotas: list[float] = []
    for directory in cgroup_dirs("", proc_root, cgroup_root):
        try:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            if quota != "max":
                quotas.append(int(quota) / int(period))
        except (OSError, ValueError, ZeroDivisionError):
            continue
    for directory in cgroup_dirs("cpu", proc_root, cgroup_root):
        try:
            v1_quota = int((directory / "cpu.cfs_quota_us").read_text())
            v1_period = int((directory / "cpu.cfs_period_us").read_text())
            if v1_quota > 0:  # -1: no quota
                quotas.append(v1_quota / v1_period)
        except (OSError, ValueError, ZeroDivisionError):
            continue
    return quotas


def gpu_visible(dev_root: Path = Path("/dev"), environ: Mapping[str, str] = os.environ) -> bool:
    """Whether torch would find a GPU here (NVIDIA or AMD ROCm), judged without loading torch.

    The device nodes are what a container runtime passes in for a GPU; ``CUDA_VISIBLE_DEVICES``
    or ``HIP_VISIBLE_DEVICES`` set to nothing (or -1) hides them from torch.
    """
    for variable in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        value = environ.get(variable)
        if value is not None and value.strip() in ("", "-1"):
            return False
    try:
        names = os.listdir(dev_root)
    except OSError:
        return False
    nvidia = any(n.startswith("nvidia") and n[len("nvidia") :].isdigit() for n in names)
    return nvidia or "kfd" in names


def status_bytes(path: Path, field: str) -> int | None:
    """A ``name: value kB`` field of a ``/proc/<pid>/status`` file, in bytes; None when the file
    or the field cannot be read."""
    return _field(path, field)


def resident_bytes(pid: int, proc_root: Path = Path("/proc")) -> int | None:
    """A process's resident memory (VmRSS), or None when it is gone or unreadable."""
    return status_bytes(proc_root / str(pid) / "status", "VmRSS")


def process_age_s(proc_root: Path = Path("/proc")) -> float | None:
    """Seconds since this process started (its start time in ``/proc/self/stat`` against the
    machine's uptime): the start-up summary counts the imports too, which run before any of
    nograd's code could start a clock. None where /proc cannot be read."""
    try:
        stat = (proc_root / "self" / "stat").read_text()
        uptime_s = float((proc_root / "uptime").read_text().split()[0])
        # After the command name (in parentheses, which may hold spaces) come the fields from
        # the third on; the 22nd, starttime, is in clock ticks since boot.
        start_ticks = int(stat.rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
