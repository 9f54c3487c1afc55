"""What the recorders of a peer's answers share (scripts/record_*_answers.py): the peer started in
its own process group with its output in a log, and stopped with the whole group."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def start_group(
    command: Sequence[str], cwd: Path, env: Mapping[str, str], log: Path
) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            list(command),
            cwd=cwd,
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_group(process: subprocess.Popen[bytes] | None, timeout_s: float = 30.0) -> None:
    """SIGTERM to the peer's process group, SIGKILL when it does not stop in time."""
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def print_log_tail(log: Path, characters: int = 6000) -> None:
    if log.exists():
        print(log.read_text("utf-8", "replace")[-characters:], file=sys.stderr)


def write_answers(out: Path, recorded_with: Mapping[str, str], answers: Mapping[str, Any]) -> None:
    document = {"recorded_with": dict(recorded_with), "answers": dict(answers)}
    out.write_text(json.dumps(document, indent=1) + "\n", "utf-8")


def run_recorder(
    doc: str,
    peer: str,
    record: Callable[[Path, Path], int],
    default_out: Path,
    argv: Sequence[str] | None = None,
) -> int:
    """A recorder's command line: the peer venv's python (built on first use), where to write."""
    from bench.peers.envs import ensure_env

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--python", type=Path, help=f"the {peer} venv's python (default: built)")
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args(argv)
    python = args.python
    if python is None:
        env = ensure_env(peer)
        if not env.ok or env.python is None:
            print(env.reason, file=sys.stderr)
            return 2
        python = env.python
    print(f"{record(python, args.out)} answers from {peer} written to {args.out}")
    return 0
