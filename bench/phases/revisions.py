"""The revisions phase: this checkout's nograd against the same server at a base revision
(``--base``), both up together, each on its own revision's shipped models and both on one
TorchServe MNIST archive, their answers compared body for body, then paired rounds at
concurrency 1 and the headline concurrency. A change meant to leave the figures alone (a
refactor) shows its ratios here, measured minutes apart on the same machine."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import PYTHON, RESULTS, ROOT, Server, nograd_server
from bench.peers.torchserve_archives import DIGITS, build_mnist
from bench.phases.archives import Answer, answers_of
from bench.phases.peers import NOGRAD, measure_rounds
from bench.session import Bench

BASE = "nograd-base"
SHIPPED = ("digits", "minilm")
GIT_TIMEOUT_S = 120
REL_TOL = 1e-4
"""Numbers in two answers agree within this: the same engine may round differently run to run."""


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float | int) and isinstance(b, float | int):
        return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=REL_TOL)
    return bool(a == b)


def same_answer(a: Answer, b: Answer) -> bool:
    """The same status, and the same body: as JSON with numbers within ``REL_TOL`` where both
    parse, byte for byte otherwise."""
    if a[0] != b[0]:
        return False
    try:
        return _close(json.loads(a[1]), json.loads(b[1]))
    except ValueError:
        return a[1] == b[1]


def compare(
    this: list[Answer], base: list[Answer], names: tuple[str, str] = (NOGRAD, BASE)
) -> dict[str, Any]:
    """How many answers agree, and the first disagreement (index, both answers under
    ``names``) if any."""
    differ = [i for i, pair in enumerate(zip(this, base, strict=True)) if not same_answer(*pair)]
    first = None
    if differ:
        i = differ[0]
        first = {
            "index": i,
            names[0]: [this[i][0], this[i][1][:200].decode(errors="replace")],
            names[1]: [base[i][0], base[i][1][:200].decode(errors="replace")],
        }
    return {"requests": len(this), "same": len(this) - len(differ), "first_difference": first}


def _git(*args: str) -> str:
    out = subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=True
    )
    return out.stdout.strip()


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def shipped_models(checkout: Path, root: Path) -> Path:
    """``root``: a repository of the checkout's own shipped models (its code reads them as that
    revision wrote them; hard links where the file system allows: nograd refuses model files
    that resolve outside its repository, so no symbolic links)."""
    root.mkdir(parents=True, exist_ok=True)
    for name in SHIPPED:
        if not (root / name).exists():
            shutil.copytree(checkout / "models" / name, root / name, copy_function=_link_or_copy)
    return root


@contextlib.contextmanager
def base_checkout(revision: str, record: dict[str, Any], prefix: str) -> Iterator[Path]:
    """A worktree of ``revision`` outside this checkout (its own tools, mypy or pytest, would walk
    a copy of the code inside it), removed at the end; its commit goes in ``record``."""
    record["base_commit"] = _git("rev-parse", f"{revision}^{{commit}}")
    checkout = Path(tempfile.mkdtemp(prefix=prefix)) / "base"
    _git("worktree", "add", "--detach", str(checkout), record["base_commit"])
    try:
        yield checkout
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            _git("worktree", "remove", "--force", str(checkout))
        shutil.rmtree(checkout.parent, ignore_errors=True)


def repository(folder: Path, label: str, checkout: Path, archive: Path) -> Path:
    """A revision's own shipped models (``shipped_models``), and the one ``mnist.mar`` with the
    sample nograd warms an archive up with."""
    root = shipped_models(checkout, folder / f"repository-{label}")
    _link_or_copy(str(archive), str(root / archive.name))
    (root / "mnist.sample.png").write_bytes(DIGITS["0"])
    return root


def base_server(checkout: Path, root: Path, cpus: str | None, env: dict[str, str]) -> Server:
    """``python -m nograd`` started in the base revision's checkout, so its own code is imported
    (the current directory comes first on ``sys.path``, and spawned workers inherit the path)."""
    server = nograd_server(root, cpus, env)
    server.name = BASE
    server.command = [PYTHON, "-m", "nograd"]
    server.cwd = checkout
    server.env = {**server.env, "PYTHONPATH": str(checkout)}
    return server


def phase_revisions(bench: Bench) -> None:
    record: dict[str, Any] = {"base": bench.plan.base_revision, "runs": []}
    bench.results["revisions"] = record
    if bench.plan.base_revision is None:
        record["refused"] = "no base revision: pass --base REV"
        bench.note(record["refused"])
        return
    folder = RESULTS / f"{bench.stamp}-revisions"
    record["this_commit"] = _git("rev-parse", "HEAD")
    record["this_dirty"] = bool(_git("status", "--porcelain", "--untracked-files=no"))
    bench.step(f"revisions: check out {bench.plan.base_revision}")
    workers = bench.plan.revision_workers
    record["workers"] = workers
    with contextlib.ExitStack() as stack:
        checkout = stack.enter_context(
            base_checkout(bench.plan.base_revision, record, "nograd-base-")
        )
        bench.step("revisions: build the repositories")
        archive = build_mnist(folder / "store", folder / "work")
        cpus = bench.plan.server_cpus
        # One engine cache: where a model is the same in both revisions, the second server
        # opens the engines the first chose, so the rounds compare the serving code.
        env = {"NOGRAD_WORKERS": workers, "NOGRAD_ENGINE_CACHE": str(folder / "engines")}
        systems: list[tuple[str, Server]] = []
        for name, server in (
            (NOGRAD, nograd_server(repository(folder, NOGRAD, ROOT, archive), cpus, env)),
            (BASE, base_server(checkout, repository(folder, BASE, checkout, archive), cpus, env)),
        ):
            bench.step(f"revisions: start {name}")
            systems.append((name, stack.enter_context(server)))
        everyone = [server for _, server in systems]
        checks: dict[str, Any] = {}
        for name in bench.plan.revision_workloads:
            wl = bench.workload(name)
            bench.bodies.setdefault(name, wl.write_bodies(RESULTS / "bodies"))
            bench.step(f"revisions: compare answers ({name})")
            this, base = (answers_of(server, wl) for server in everyone)
            checks[name] = compare(this, base)
        record["check"] = checks
        differ = {n: c for n, c in checks.items() if c["same"] != c["requests"]}
        if differ:
            record["refused"] = f"answers differ between the revisions: {differ}"[:600]
            bench.note(record["refused"])
            return
        lineup = {name: systems for name in bench.plan.revision_workloads}
        concurrencies = sorted({1, bench.plan.concurrency}, reverse=True)
        record["runs"] = measure_rounds(bench, lineup, everyone, concurrencies, "revisions")
