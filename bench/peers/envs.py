"""One virtual environment per peer, created by the bench, pinned, and built only once.

Each peer (Triton through PyTriton, TorchServe, infinity) needs packages that clash with nograd's
(numpy < 2, an older transformers, Java's frontend) or with each other, so each gets its own
venv under ``bench/.peers/<peer>/venv`` (git-ignored), installed from
``bench/peers/requirements/<peer>.txt``: torch first (the CPU build this machine's pip picks for
``torch==2.13.0``, so no multi-GB CUDA wheel is pulled), then the rest, then the peer's fix-ups.
A stamp file holding the digest of the requirements and fix-ups makes a second run skip the
install; a changed list rebuilds the venv from scratch.

A peer that cannot run is not an error for the bench: :func:`ensure_env` returns a
:class:`PeerEnv` whose ``reason`` says why in one line (no Java, glibc too old, pip failed, an
import check failed, a step timed out), and the bench reports it and measures the others.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

BENCH_DIR: Final = Path(__file__).resolve().parents[1]
ROOT: Final = BENCH_DIR.parent
PEERS_DIR: Final = BENCH_DIR / ".peers"
REQUIREMENTS_DIR: Final = Path(__file__).resolve().parent / "requirements"
CONSTRAINTS: Final = ROOT / "constraints.txt"
STAMP_NAME: Final = ".nograd-peer-stamp"

VENV_TIMEOUT_S: Final = 180.0
INSTALL_TIMEOUT_S: Final = 1800.0
CHECK_TIMEOUT_S: Final = 180.0


@dataclass(frozen=True)
class PeerSpec:
    """What a peer's environment needs beyond its requirements file."""

    name: str
    smoke_import: str
    """Python run in the new venv to prove the install works (imports only, no server)."""
    fixups: tuple[tuple[str, ...], ...] = ()
    """pip commands run after the install, e.g. removing a package an extra pulled in."""
    needs_java: bool = False
    min_glibc: tuple[int, int] | None = None
    constrained: bool = True
    """Installed under ``constraints.txt`` (the CPU torch pin); off for a peer whose torch must
    be the one its other wheels were built against."""

    @property
    def requirements(self) -> Path:
        return REQUIREMENTS_DIR / f"{self.name}.txt"


SPECS: Final = {
    "pytriton": PeerSpec(
        "pytriton",
        "import numpy, pytriton.triton, transformers, tokenizers, safetensors; "
        "assert int(numpy.__version__.split('.')[0]) < 2, numpy.__version__",
        min_glibc=(2, 35),
    ),
    "torchserve": PeerSpec(
        "torchserve",
        "import ts, model_archiver, transformers, tokenizers, safetensors",
        needs_java=True,
    ),
    "torchserve-vision": PeerSpec(
        "torchserve-vision",
        "import torchvision.transforms, captum, ts.torch_handler.image_classifier, model_archiver",
        needs_java=True,
        constrained=False,
    ),
    "infinity": PeerSpec(
        "infinity",
        "import infinity_emb, optimum.onnxruntime, onnxruntime, sentence_transformers",
        # infinity's extras can pull a torchvision built against another torch, which then
        # breaks importing transformers; nothing here uses it.
        fixups=(("uninstall", "-y", "torchvision"),),
    ),
}
PEERS: Final = tuple(SPECS)


@dataclass(frozen=True)
class PeerEnv:
    """A peer's venv python, or the one-line reason it cannot run."""

    name: str
    python: Path | None
    reason: str | None = None
    installed_now: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.python is not None and self.reason is None


Runner = Callable[..., subprocess.CompletedProcess[str]]


class StepFailed(Exception):
    """An install step that failed; its message is the peer's one-line reason."""


def venv_dir(peer: str, root: Path = PEERS_DIR) -> Path:
    return root / peer / "venv"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def requirement_lines(path: Path) -> list[str]:
    """The requirement lines of ``path``, comments and blank lines dropped."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text("utf-8").splitlines())
    return [line for line in lines if line]


def stamp_digest(spec: PeerSpec, base_python: str) -> str:
    """What a built venv depends on: its requirements, fix-ups, import check and the
    interpreter it was made from (pyenv's path names the version)."""
    digest = hashlib.sha256()
    for line in requirement_lines(spec.requirements):
        digest.update(line.encode() + b"\n")
    for fixup in spec.fixups:
        digest.update(" ".join(fixup).encode() + b"\n")
    digest.update(spec.smoke_import.encode() + b"\n")
    digest.update(str(Path(base_python).resolve()).encode())
    return digest.hexdigest()


def glibc_version() -> tuple[int, int] | None:
    """The C library's version, or None where it is not glibc."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        text = ""
    parts = text.split()
    if len(parts) != 2 or parts[0] != "glibc":
        return None
    major, _, minor = parts[1].partition(".")
    try:
        return int(major), int(minor.split(".")[0] or 0)
    except ValueError:
        return None


def preflight_reason(
    spec: PeerSpec,
    *,
    which: Callable[[str], str | None] = shutil.which,
    glibc: Callable[[], tuple[int, int] | None] = glibc_version,
) -> str | None:
    """Why the peer cannot run on this machine whatever gets installed, or None."""
    if spec.needs_java and which("java") is None:
        return f"{spec.name}: java not found on PATH (TorchServe's frontend needs a JDK, e.g. 17)"
    if spec.min_glibc is not None:
        found = glibc()
        want = ".".join(map(str, spec.min_glibc))
        if found is None:
            return f"{spec.name}: needs glibc >= {want}; this C library is not glibc"
        if found < spec.min_glibc:
            have = ".".join(map(str, found))
            return f"{spec.name}: needs glibc >= {want}, this machine has {have}"
    return None


def ensure_env(
    peer: str,
    *,
    root: Path = PEERS_DIR,
    base_python: str = sys.executable,
    runner: Runner = subprocess.run,
    which: Callable[[str], str | None] = shutil.which,
    glibc: Callable[[], tuple[int, int] | None] = glibc_version,
    install_timeout_s: float = INSTALL_TIMEOUT_S,
) -> PeerEnv:
    """The peer's venv, built now unless a stamp says the same one is there already.

    Every expected failure comes back as ``reason``; nothing is raised for it.
    """
    started = time.monotonic()
    spec = SPECS.get(peer)
    if spec is None:
        return PeerEnv(peer, None, f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
    reason = preflight_reason(spec, which=which, glibc=glibc)
    if reason is not None:
        return PeerEnv(peer, None, reason)
    venv = venv_dir(peer, root)
    python = venv_python(venv)
    try:
        digest = stamp_digest(spec, base_python)
    except OSError as exc:
        return PeerEnv(peer, None, f"{peer}: cannot read {spec.requirements}: {exc}")
    stamp = venv / STAMP_NAME
    if python.exists() and stamp.is_file() and stamp.read_text("utf-8").strip() == digest:
        return PeerEnv(peer, python, seconds=time.monotonic() - started)
    log = root / peer / "install.log"
    try:
        _build(spec, venv, base_python, runner, log, install_timeout_s)
    except StepFailed as exc:
        return PeerEnv(peer, None, f"{peer}: {exc}", seconds=time.monotonic() - started)
    stamp.write_text(digest + "\n", "utf-8")
    return PeerEnv(peer, python, installed_now=True, seconds=time.monotonic() - started)


def _build(
    spec: PeerSpec, venv: Path, base_python: str, runner: Runner, log: Path, timeout_s: float
) -> None:
    """A fresh venv: venv, torch, the requirements, the fix-ups, the import check."""
    if venv.exists():
        shutil.rmtree(venv)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("", "utf-8")
    _step(runner, [base_python, "-m", "venv", str(venv)], "creating the venv", log, VENV_TIMEOUT_S)
    python = str(venv_python(venv))
    lines = requirement_lines(spec.requirements)
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check"]
    if spec.constrained and CONSTRAINTS.is_file():
        pip += ["-c", str(CONSTRAINTS)]
    deadline = time.monotonic() + timeout_s
    torch_pins = [line for line in lines if line.startswith("torch==")]
    if torch_pins:
        _step(runner, [*pip, *torch_pins], "pip install torch", log, _left(deadline))
    _step(runner, [*pip, "-r", str(spec.requirements)], "pip install", log, _left(deadline))
    for fixup in spec.fixups:
        command = [python, "-m", "pip", "--disable-pip-version-check", *fixup]
        _step(runner, command, f"pip {' '.join(fixup)}", log, _left(deadline))
    _step(runner, [python, "-c", spec.smoke_import], "import check", log, CHECK_TIMEOUT_S)


def _left(deadline: float) -> float:
    return max(1.0, deadline - time.monotonic())


def _step(runner: Runner, command: Sequence[str], what: str, log: Path, timeout_s: float) -> None:
    """Run one install step, appending its output to ``log``; a failure raises
    :class:`StepFailed` with the step, its exit status and the last line it printed."""
    try:
        out = runner(
            list(command),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        raise StepFailed(f"{what} timed out after {timeout_s:.0f}s (log: {log})") from None
    except OSError as exc:
        raise StepFailed(f"{what} could not start: {exc}") from None
    with log.open("a", encoding="utf-8") as handle:
        handle.write(f"$ {' '.join(command)}\n{out.stdout}{out.stderr}\n")
    if out.returncode != 0:
        raise StepFailed(
            f"{what} failed (exit {out.returncode}): {last_line(out.stderr or out.stdout)}"
            f" (log: {log})"
        )


def last_line(text: str) -> str:
    """The last non-empty line, the one pip and Python put the error on."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def ensure_all(peers: Sequence[str] = PEERS) -> dict[str, PeerEnv]:
    """Every peer's environment, one after the other (pip on two cores is CPU-bound)."""
    return {peer: ensure_env(peer) for peer in peers}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.peers.envs [peer ...]``: build the venvs, print one line per peer."""
    peers = list(argv if argv is not None else sys.argv[1:]) or list(PEERS)
    failed = 0
    for peer, env in ensure_all(peers).items():
        if env.ok:
            action = "installed" if env.installed_now else "up to date"
            print(f"{peer}: {action} in {env.seconds:.0f}s: {env.python}")
        else:
            failed += 1
            print(f"{peer}: cannot run: {env.reason}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
