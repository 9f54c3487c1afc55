"""The shipped models exported once per test run: an export of minilm takes seconds of both cores,
and the export tests and the tests that serve exported folders ask for the same ones.

Each export lives in the run's engine cache (``NOGRAD_ENGINE_CACHE``, which every parallel worker
inherits from ``tests/conftest.py`` or ``make test``), under a key of the model's files, nograd's
source and torch's version: a cache kept between runs never hands back an export of other code.
A file lock lets whichever test asks first export it while another worker asking waits for it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

import torch

from nograd.runtime.engines.export import export_model

ROOT = Path(__file__).resolve().parents[1]


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
    store = Path(os.environ["NOGRAD_ENGINE_CACHE"]) / "exports" / _source_key(name)
    store.mkdir(parents=True, exist_ok=True)
    folder = store / f"{name}-{to}"
    done = store / f"{name}-{to}.done"
    with (store / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
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
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder
