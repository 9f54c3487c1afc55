"""A server's processes as ``/proc`` shows them: the process and everything it started, which of
them map a library, their proportional memory (PSS) and the TCP connections each holds. Every
function takes the ``/proc`` root, so a test can hand it a tree of its own."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")
ESTABLISHED = "01"
"""A TCP socket's state in ``/proc/net/tcp``, once the handshake is done."""


def parent_of(stat: str) -> int:
    """The parent pid in a ``/proc/PID/stat`` line; the command name before it, in brackets,
    may hold spaces and brackets of its own, so the fields count from its last ``)``."""
    return int(stat.rpartition(")")[2].split()[1])


def descendants(pid: int, proc: Path = PROC) -> list[int]:
    """``pid`` and every process below it, parents before their children. Read from each
    process's ``stat``: ``/proc/PID/task/*/children`` needs a kernel option not every kernel
    has."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(parent_of(stat), []).append(int(entry.name))
    found = [pid]
    walked = 0
    while walked < len(found):  # breadth first
        found += sorted(children.get(found[walked], []))
        walked += 1
    return found


def pss_bytes(pid: int, proc: Path = PROC) -> int:
    """The process's proportional set size: each page it maps divided among the processes that
    share it, so a group's sum counts shared libraries and memory once. 0 for a process gone."""
    try:
        text = (proc / str(pid) / "smaps_rollup").read_text()
    except OSError:
        return 0
    total_kib = 0
    for line in text.splitlines():
        if line.startswith("Pss:"):
            total_kib += int(line.split()[1])
    return total_kib * 1024


def maps_library(pid: int, name: str, proc: Path = PROC) -> bool:
    """Whether any mapping of the process is a file whose path holds ``name``."""
    try:
        maps = (proc / str(pid) / "maps").read_text()
    except OSError:
        return False
    return any(name in line for line in maps.splitlines())


def established_inodes(port: int, proc: Path = PROC) -> set[int]:
    """The socket inodes of the established TCP connections (IPv4 and IPv6) whose local port is
    ``port``: the server's side of its clients' connections."""
    found: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == ESTABLISHED and int(local.rpartition(":")[2], 16) == port:
                found.add(int(inode))
    return found


def socket_inodes(pid: int, proc: Path = PROC) -> set[int]:
    """The inodes of the sockets the process holds open (its ``fd`` links ``socket:[N]``)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for fd in (proc / str(pid) / "fd").iterdir():
            with contextlib.suppress(OSError):  # closed meanwhile
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    found.add(int(target[len("socket:[") : -1]))
    return found


def connections_held(pids: Iterable[int], port: int, proc: Path = PROC) -> dict[int, int]:
    """Per process, how many of the established connections to ``port`` it holds a descriptor
    of."""
    connections = established_inodes(port, proc)
    return {pid: len(socket_inodes(pid, proc) & connections) for pid in pids}
