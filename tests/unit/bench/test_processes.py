"""The processes phase's pure parts: a server's process tree, memory and connections read from a
fake ``/proc`` and from this test's own process, the supervisor's log read back, and the
section's ratios and verdicts (no server)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.phases.processes import model_table, ready_after, role_of, roles
from bench.plan import Plan
from bench.process_tree import (
    connections_held,
    descendants,
    established_inodes,
    maps_library,
    parent_of,
    pss_bytes,
)
from bench.report.processes import (
    processes_section,
    pss_ratio,
    rps_ratios,
    start_ratios,
    target_rows,
)
from bench.report.revisions import revision_rows
from bench.run import ON_REQUEST, command_line

TCP_HEADER = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout "
    "inode\n"
)


def tcp_line(local_port: int, state: str, inode: int) -> str:
    local = f"0100007F:{local_port:04X}"
    return (
        f"   0: {local} 0100007F:D431 {state} 00000000:00000000 00:00000000 00000000  1000  "
        f"      0 {inode} 1\n"
    )


def process(proc: Path, pid: int, parent: int, command: str = "python") -> Path:
    folder = proc / str(pid)
    folder.mkdir(parents=True)
    (folder / "stat").write_text(f"{pid} ({command}) S {parent} {pid} {pid} 0 -1 4194560 1\n")
    (folder / "fd").mkdir()
    return folder


def test_the_parent_is_read_after_a_command_name_with_spaces_and_brackets() -> None:
    assert parent_of("42 (my (odd) name) S 7 42 42 0") == 7


def test_descendants_walk_the_whole_tree_below_a_pid_and_nothing_else(tmp_path: Path) -> None:
    process(tmp_path, 1, 0, "init")
    process(tmp_path, 10, 1, "nograd")
    process(tmp_path, 11, 10, "nograd-engine")
    process(tmp_path, 12, 10, "nograd front 1")
    process(tmp_path, 13, 11, "resource (tracker)")
    process(tmp_path, 20, 1, "someone else")
    (tmp_path / "30").mkdir()  # a process gone before its stat was read
    (tmp_path / "self").mkdir()
    assert descendants(10, tmp_path) == [10, 11, 12, 13]
    assert descendants(12, tmp_path) == [12]


def test_pss_sums_the_pss_line_only_and_a_process_gone_has_none(tmp_path: Path) -> None:
    folder = process(tmp_path, 10, 1)
    (folder / "smaps_rollup").write_text(
        "55d0-7ffd ---p 00000000 00:00 0   [rollup]\n"
        "Rss:                1676 kB\n"
        "Pss:                 210 kB\n"
        "Pss_Dirty:           116 kB\n"
        "Pss_Anon:            116 kB\n"
        "Shared_Clean:       1516 kB\n"
    )
    assert pss_bytes(10, tmp_path) == 210 * 1024
    assert pss_bytes(99, tmp_path) == 0


def test_a_library_is_found_in_the_maps(tmp_path: Path) -> None:
    folder = process(tmp_path, 10, 1)
    (folder / "maps").write_text(
        "7f00-7f10 r-xp 00000000 08:01 123 /venv/lib/torch/lib/libtorch_cpu.so\n"
    )
    process(tmp_path, 11, 1)
    (tmp_path / "11" / "maps").write_text("7f00-7f10 r-xp 00000000 08:01 9 /usr/lib/libc.so.6\n")
    assert maps_library(10, "libtorch", tmp_path)
    assert not maps_library(11, "libtorch", tmp_path)
    assert not maps_library(12, "libtorch", tmp_path)


def test_only_established_connections_to_the_port_count_per_process(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(
        TCP_HEADER
        + tcp_line(8080, "01", 100)  # a client's connection, established
        + tcp_line(8080, "0A", 101)  # the listening socket
        + tcp_line(9090, "01", 102)  # another port
        + tcp_line(8080, "01", 104)
    )
    (tmp_path / "net" / "tcp6").write_text(TCP_HEADER + tcp_line(8080, "01", 103))
    assert established_inodes(8080, tmp_path) == {100, 103, 104}
    front = process(tmp_path, 11, 10)
    for fd, inode in enumerate((100, 101, 102)):
        os.symlink(f"socket:[{inode}]", front / "fd" / str(fd))
    other = process(tmp_path, 12, 10)
    os.symlink("socket:[103]", other / "fd" / "0")
    os.symlink("socket:[104]", other / "fd" / "1")
    os.symlink("/dev/null", other / "fd" / "2")
    engine = process(tmp_path, 13, 10)
    os.symlink("socket:[555]", engine / "fd" / "0")  # a Unix socket to a front
    assert connections_held([11, 12, 13, 14], 8080, tmp_path) == {11: 1, 12: 2, 13: 0, 14: 0}


def test_the_real_proc_shows_this_process_its_child_and_its_connection() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert descendants(os.getpid())[0] == os.getpid()
        assert child.pid in descendants(os.getpid())
        assert pss_bytes(os.getpid()) > 0
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            port = listener.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port)) as _client:
                accepted, _ = listener.accept()
                with accepted:
                    # The client's end has another local port: only the accepted end counts.
                    assert connections_held([os.getpid(), child.pid], port) == {
                        os.getpid(): 1,
                        child.pid: 0,
                    }
    finally:
        child.kill()
        child.wait()


LOG = """\
2026-11-28 21:00:00,352 INFO nograd.supervisor: engine started (pid 101)
2026-11-28 21:00:00,352 INFO nograd.supervisor: front 1 started (pid 102)
2026-11-28 21:00:00,352 INFO nograd.supervisor: front 2 started (pid 103)
2026-11-28 21:00:01,352 INFO nograd.supervisor: front 1 ready after 0.8s, 0.05 GB resident
2026-11-28 21:00:12,352 INFO nograd.supervisor: engine ready after 12.5s, 0.61 GB resident
2026-11-28 21:00:20,352 INFO nograd.supervisor: front 1 started (pid 104)
"""


def test_the_log_names_each_process_and_its_time_to_ready() -> None:
    names = roles(LOG, 100)
    assert names == {
        100: "supervisor",
        101: "engine",
        102: "front 1",
        103: "front 2",
        104: "front 1",
    }
    assert role_of(105, names) == "pid 105"
    assert ready_after(LOG) == {"front 1": 0.8, "engine": 12.5}


def test_the_model_table_gives_each_models_engine_and_limit() -> None:
    log = (
        "2026-11-28 21:00:12,352 INFO nograd.serving.control.ready_summary: ready: serving 2\n"
        "    model   version  state  format  engine          device  limit  unit     weights\n"
        "    ------  -------  -----  ------  --------------  ------  -----  -------  -------\n"
        "    digits  1        ready  python  onnx            cpu        64  samples  169 KiB\n"
        "    minilm  1        ready  python  onnx<=16,eager  cpu      3328  tokens   172 MiB\n"
    )
    assert model_table(log) == {
        "digits": {"engine": "onnx", "limit": "64 samples"},
        "minilm": {"engine": "onnx<=16,eager", "limit": "3328 tokens"},
    }
    assert model_table(LOG) == {}


def paired(system: str, workload: str, round_: int, rps: float, p99: float) -> dict[str, Any]:
    return {
        "round": round_,
        "position": 0,
        "system": system,
        "workload": workload,
        "concurrency": 32,
        "rps": rps,
        "p99_ms": p99,
        "errors": 0,
    }


def start(round_: int, system: str, kind: str, seconds: float) -> dict[str, Any]:
    return {
        "round": round_,
        "system": system,
        "kind": kind,
        "seconds": seconds,
        "foreign_cpu_cores": 0.1,
        "ready_after": {"engine": seconds - 1},
        "log": [],
    }


def memory(pss: float) -> dict[str, Any]:
    return {"pss_bytes": pss, "by_process": {}}


def record() -> dict[str, Any]:
    return {
        "workers": "2",
        "fronts": "2",
        "start_ups": [
            start(1, "workers", "cold", 60.0),
            start(1, "workers", "warm", 40.0),
            start(1, "engine", "cold", 30.0),
            start(1, "engine", "warm", 16.0),
            start(2, "engine", "cold", 36.0),
            start(2, "engine", "warm", 30.0),
            start(2, "workers", "cold", 60.0),
            start(2, "workers", "warm", 50.0),
            start(3, "workers", "warm", 50.0),  # its engine start failed: no ratio
        ],
        "processes": {
            "workers": {
                "processes": [
                    {"pid": 1, "role": "supervisor", "libtorch": False},
                    {"pid": 2, "role": "worker 0", "libtorch": True},
                    {"pid": 3, "role": "worker 1", "libtorch": True},
                ],
                "libtorch": 2,
                "models": {"digits": {"engine": "onnx", "limit": "64 samples"}},
            },
            "engine": {
                "processes": [
                    {"pid": 4, "role": "supervisor", "libtorch": False},
                    {"pid": 5, "role": "engine", "libtorch": True},
                    {"pid": 6, "role": "front 1", "libtorch": False},
                    {"pid": 7, "role": "front 2", "libtorch": False},
                ],
                "libtorch": 1,
                "models": {"digits": {"engine": "onnx", "limit": "64 samples"}},
            },
        },
        "check": {"digits": {"requests": 64, "same": 64, "first_difference": None}},
        "shared_cache": "workers",
        "memory_warm": {"workers": memory(2.0e9), "engine": memory(1.2e9)},
        "memory_after_rounds": {"workers": memory(2.0e9), "engine": memory(1.4e9)},
        "connections": {
            "workers": {
                "connections": 32,
                "answered": 32,
                "by_process": {"supervisor": 0, "worker 0": 20, "worker 1": 12},
                "holding": 2,
            },
            "engine": {
                "connections": 32,
                "answered": 32,
                "by_process": {"supervisor": 0, "engine": 0, "front 1": 32, "front 2": 0},
                "holding": 1,
            },
        },
        "runs": [
            paired("workers", "digits", 1, 1000.0, 40.0),
            paired("engine", "digits", 1, 950.0, 44.0),
            paired("engine", "digits", 2, 800.0, 50.0),
            paired("workers", "digits", 2, 1000.0, 40.0),
            paired("workers", "digits", 3, 1000.0, 40.0),
            paired("engine", "digits", 3, 1000.0, 40.0),
            paired("workers", "minilm-1", 1, 100.0, 400.0),
            paired("engine", "minilm-1", 1, 99.0, 380.0),
            paired("engine", "minilm-1", 2, 98.0, 390.0),  # its workers run failed: no ratio
        ],
    }


def test_ratios_pair_each_round_and_skip_a_round_one_system_missed() -> None:
    found = record()
    assert start_ratios(found["start_ups"], "warm") == [0.4, 0.6]
    assert start_ratios(found["start_ups"], "cold") == [0.5, 0.6]
    assert pss_ratio(found, "memory_warm") == pytest.approx(0.6)
    assert pss_ratio(found, "memory_after_rounds") == pytest.approx(0.7)
    assert pss_ratio({}, "memory_warm") is None
    assert rps_ratios(found, "digits", 32) == [0.95, 0.8, 1.0]
    assert rps_ratios(found, "minilm-1", 32) == [0.99]
    assert rps_ratios(found, "minilm-1", 1) == []


def test_each_target_takes_the_median_of_its_rounds() -> None:
    rows = {row[0]: row[1:] for row in target_rows(record(), 32)}
    assert rows["engine system: processes mapping libtorch"] == ("1", "exactly 1", "**met**")
    assert rows["engine system: processes holding 32 connections"] == ("1", "≥ 2", "**not met**")
    assert rows["process group PSS engine ÷ workers (warm)"] == ("0.60×", "≤ 0.65×", "**met**")
    assert rows["process group PSS engine ÷ workers (after the rounds)"][2] == "**not met**"
    assert rows["warm start to ready engine ÷ workers"] == (
        "0.50× (0.40 / 0.60)",
        "≤ 0.5×",
        "**met**",
    )
    assert rows["cold start to ready engine ÷ workers"][2] == "–"
    assert rows["digits c=32 req/s engine ÷ workers"] == (
        "0.95× (0.95 / 0.80 / 1.00)",
        "≥ 0.9×",
        "**met**",
    )
    assert rows["minilm-1 c=32 req/s engine ÷ workers"][2] == "**met**"


def test_the_section_shows_each_system_the_rounds_and_every_start() -> None:
    results = {"meta": {"plan": {"concurrency": 32}}, "processes": record()}
    text = "\n".join(processes_section(results, "2 cores"))
    assert "`NOGRAD_FRONTS=2`" in text and "`NOGRAD_WORKERS=2`" in text
    assert "answers agreeing digits 64/64" in text
    workers = "| workers | 3 | worker 0, worker 1 | 2.0 | 2.0 | 60.0 | 50.0 |"
    assert f"{workers} worker 0 20, worker 1 12 (32/32 answered) |" in text
    assert "| engine | 4 | engine | 1.2 | 1.4 | 33.0 | 23.0 | front 1 32 (32/32 answered) |" in text
    assert "| digits | 32 | 3 | 950 | 1,000 | 0.95× (0.95 / 0.80 / 1.00) |" in text
    assert "| 1.10× (1.10 / 1.25 / 1.00) | 0 / 0 |" in text
    assert "workers: digits onnx (64 samples); engine: digits onnx (64 samples)" in text
    assert "| 1 | engine | warm | 16.0 | 0.10 | engine 15.0 s |" in text
    assert processes_section({"meta": {"plan": {"concurrency": 32}}}, "2 cores") == []


def with_base() -> dict[str, Any]:
    """``record()`` with the base revision's workers measured beside the other two."""
    found = record()
    found["systems"] = ["workers", "engine", "base"]
    found["base"] = "e66dee9^"
    found["base_commit"] = "0123456789abcdef"
    found["start_ups"] += [start(1, "base", "warm", 64.0), start(2, "base", "warm", 60.0)]
    found["processes"]["base"] = found["processes"]["workers"]
    found["memory_warm"]["base"] = memory(2.4e9)
    found["memory_after_rounds"]["base"] = memory(2.4e9)
    found["runs"] += [
        paired("base", "digits", 1, 1000.0, 40.0),
        paired("base", "digits", 2, 900.0, 40.0),
        paired("base", "digits", 3, 1000.0, 40.0),
    ]
    return found


def test_with_a_base_revision_the_targets_are_stated_against_it_first() -> None:
    rows = [row for row in target_rows(with_base(), 32)]
    labels = [row[0] for row in rows]
    assert labels.index("warm start to ready engine ÷ base") < labels.index(
        "warm start to ready engine ÷ workers"
    )
    found = {row[0]: row[1:] for row in rows}
    assert found["warm start to ready engine ÷ base"] == (
        "0.38× (0.25 / 0.50)",
        "≤ 0.5×",
        "**met**",
    )
    assert found["process group PSS engine ÷ base (warm)"][0] == "0.50×"
    assert found["digits c=32 req/s engine ÷ base"][0] == "0.95× (0.95 / 0.89 / 1.00)"
    # Against this checkout's workers, as without a base.
    assert found["digits c=32 req/s engine ÷ workers"][0] == "0.95× (0.95 / 0.80 / 1.00)"
    results = {"meta": {"plan": {"concurrency": 32}}, "processes": with_base()}
    text = "\n".join(processes_section(results, "2 cores"))
    assert "of revision `e66dee9^` (0123456789ab)" in text
    assert "| base | digits | 32 | 3 | 950 | 1,000 |" in text
    assert "| workers | digits | 32 | 3 | 950 | 1,000 |" in text
    assert "| base | 3 | worker 0, worker 1 | 2.4 |" in text


def test_the_revisions_table_still_pairs_its_own_rounds() -> None:
    runs = [
        paired("nograd", "digits", 1, 1000.0, 40.0),
        paired("nograd-base", "digits", 1, 800.0, 50.0),
        paired("nograd", "digits", 2, 900.0, 40.0),
    ]
    assert revision_rows({"revisions": {"runs": runs}}) == [
        ("digits", 32, 1, 1000.0, 800.0, "1.250×", 40.0, 50.0, "0.800×", 0)
    ]


def test_the_phase_is_run_on_request_with_its_options() -> None:
    assert "processes" in ON_REQUEST
    parser = command_line()
    assert "processes" in parser.format_help()
    plan = Plan.from_args(parser.parse_args(["--phases", "processes"]))
    assert (plan.process_workers, plan.process_fronts, plan.process_starts) == ("2", "auto", 1)
    args = ["--process-workers", "3", "--process-fronts", "4", "--process-starts", "2"]
    plan = Plan.from_args(parser.parse_args(args))
    assert (plan.process_workers, plan.process_fronts, plan.process_starts) == ("3", "4", 2)
