"""The shipped models' exports and built engines, made once per test run: an export or an ONNX
build of minilm takes seconds of both cores, and several tests ask for the same ones.

Both live in the run's engine cache (``NOGRAD_ENGINE_CACHE``, which every parallel worker inherits
from ``tests/conftest.py`` or ``make test``). An export is kept under a key of the model's files,
nograd's source and torch's version, a built engine under the key the server names it by (its
engine, libraries, code and weights): a cache kept between runs never hands back one of other
code. A file lock lets whichever test comes first make one while another worker asking waits.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from nograd.core.engines import ENGINES
from nograd.runtime.engines.export import export_model

ROOT = Path(__file__).resolve().parents[1]
BUILT_SUFFIXES = frozenset(row.suffix for row in ENGINES if row.suffix)
"""The artifacts a server builds into its engine cache (``<model>-v<version>-<engine>-<key>``)."""


def _source_key(name: str) -> str:
    """What an export of model ``name`` depends on: its folder, nograd's code, torch."""
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted([*(ROOT / "models" / name).rglob("*"), *(ROOT / "nograd").rglob("*.py")]):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()[:24]


def shipped_export(name: str, to: str) -> Path:
    """The folder ``nograd export models/<name> --to <to>`` writes (``<name>-<to>`` beside a copy
    of the model, its default place), exported by the first test of the run that asks for it.
    Callers only read it: a test that changes an export copies it first."""
    # One folder and lock per model and format: a worker exporting one format never waits
    # for another worker's export of another.
    store = Path(os.environ["NOGRAD_ENGINE_CACHE"]) / "exports" / _source_key(name) / to
    store.mkdir(parents=True, exist_ok=True)
    folder = store / f"{name}-{to}"
    done = store / f"{name}-{to}.done"
    with _locked(store):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a run stopped mid-export
            if not (store / name).is_dir():
                copying = store / f".{name}.copying"
                shutil.rmtree(copying, ignore_errors=True)
                shutil.copytree(ROOT / "models" / name, copying)
                copying.rename(store / name)
            exported = export_model(store / name, to)
            assert exported.folder == folder, (exported.folder, folder)
            done.touch()
    return folder


@contextmanager
def _locked(store: Path) -> Iterator[None]:
    """``store`` to this process alone (every worker's tests take the same lock file)."""
    with (store / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _built_engines() -> Path:
    store = Path(os.environ["NOGRAD_ENGINE_CACHE"]) / "built-engines"
    store.mkdir(parents=True, exist_ok=True)
    return store


def _copy_artifacts(source: Path, target: Path) -> None:
    """The engine artifacts directly in ``source`` that ``target`` lacks, each copied beside its
    place and renamed into it: a server opening ``target`` never finds half a file."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        whole = path.is_file() and not path.name.startswith(".")
        if whole and path.suffix in BUILT_SUFFIXES and not (target / path.name).exists():
            copying = target / f".{path.name}.copying"
            shutil.copyfile(path, copying)
            copying.rename(target / path.name)


def publish_built_engines(cache: Path) -> None:
    """Offer the engines a test's server built into its own ``cache`` to the rest of the run
    (``seed_built_engines``): its choices and memory profiles stay its own."""
    store = _built_engines()
    with _locked(store):
        _copy_artifacts(cache, store)


def seed_built_engines(cache: Path) -> None:
    """Put the engines another test of the run built (``publish_built_engines``) into ``cache``:
    a server of the same model code and weights opens them instead of building them again, and
    still checks, times and profiles them itself. For tests about what a server measures, not
    about building: with nothing published yet, the server builds them as usual."""
    store = _built_engines()
    with _locked(store):
        _copy_artifacts(store, cache)
