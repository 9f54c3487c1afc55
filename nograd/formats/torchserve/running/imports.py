"""How archive code finds its imports: ``ts`` (and, without torchvision installed,
``torchvision.transforms``) as nograd's stand-ins, and the archive's own files by their plain
names, as TorchServe puts the model folder on the path.

Each archive's own modules are imported with only its folder on the path and taken out of
``sys.modules`` afterwards, so two archives that both ship ``model.py`` each get their own; its
``handle`` calls run the same way, so a module it imports lazily is found, and found again.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

_PACKAGE = __name__.rsplit(".", 1)[0]
STAND_INS = {"ts": f"{_PACKAGE}.ts"}
VISION = {"torchvision": f"{_PACKAGE}.vision"}
_LOCK = threading.Lock()
"""One archive's imports at a time: the path and ``sys.modules`` are the process's."""


class ModuleNames(NamedTuple):
    all: frozenset[str]
    """Every top-level module: ``x.py`` files and ``x/__init__.py`` packages."""
    packages: frozenset[str]


TORCHVISION = ModuleNames(frozenset({"torchvision"}), frozenset({"torchvision"}))


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``alias.x`` as the already importable module ``real.x`` (the same object)."""

    def __init__(self, aliases: dict[str, str]) -> None:
        self.aliases = aliases

    def _real(self, fullname: str) -> str | None:
        for alias, real in self.aliases.items():
            if fullname == alias or fullname.startswith(alias + "."):
                return real + fullname[len(alias) :]
        return None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        real = self._real(fullname)
        if real is None or importlib.util.find_spec(real) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        real = self._real(spec.name)
        assert real is not None
        return importlib.import_module(real)

    def exec_module(self, module: ModuleType) -> None:
        """The real module ran already when it was imported."""


_TS = _StandIns(STAND_INS)


def install_stand_ins() -> None:
    """``ts`` resolves to nograd's stand-in from now on (once, first on the meta path)."""
    if _TS not in sys.meta_path:
        sys.meta_path.insert(0, _TS)


@contextlib.contextmanager
def archive_imports(folder: Path, owned: dict[str, ModuleType]) -> Iterator[None]:
    """Run an archive's code (its load, and each ``handle`` call, which may import lazily): its
    folder first on the path, its module names free of any other archive's and bound to the
    modules it imported before (``owned``), torchvision's transforms stood in for when
    torchvision is absent. The modules it imported from its folder go into ``owned`` and out of
    ``sys.modules``."""
    install_stand_ins()
    names = _module_names(folder)
    vision = None if _has_torchvision() else _StandIns(VISION)
    with _LOCK:
        stashed = {n: sys.modules[n] for n in _loaded(names, sys.modules)}
        for name in stashed:
            del sys.modules[name]
        sys.modules.update(owned)
        sys.path.insert(0, str(folder))
        if vision is not None:
            sys.meta_path.insert(0, vision)
        if str(folder) not in sys.path_importer_cache:
            importlib.invalidate_caches()
        try:
            yield
        finally:
            sys.path.remove(str(folder))
            if vision is not None:
                sys.meta_path.remove(vision)
                for name in (
                    _loaded(TORCHVISION, sys.modules) if "torchvision" in sys.modules else ()
                ):
                    del sys.modules[name]
            for name in _loaded(names, sys.modules):
                owned[name] = sys.modules.pop(name)
            sys.modules.update(stashed)


@functools.lru_cache(maxsize=256)
def _module_names(folder: Path) -> ModuleNames:
    """The top-level modules an unpacked archive holds (its folder is named by its content, so
    this never changes)."""
    packages = frozenset(p.name for p in folder.iterdir() if (p / "__init__.py").is_file())
    return ModuleNames(frozenset(p.stem for p in folder.glob("*.py")) | packages, packages)


def _loaded(names: ModuleNames, modules: Mapping[str, ModuleType]) -> list[str]:
    """The modules of ``names`` in ``modules``: the plain ones looked up by name (cheap, once per
    batch), the packages' submodules found by a scan, only for archives that hold a package."""
    if not names.packages:
        return [name for name in names.all if name in modules]
    return [name for name in modules if name.partition(".")[0] in names.all]


@functools.lru_cache(maxsize=1)
def _has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None
