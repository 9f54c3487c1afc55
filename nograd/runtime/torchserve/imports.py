"""How archive code finds its imports: ``ts`` (and, without torchvision installed,
``torchvision.transforms``) as nograd's stand-ins, and the archive's own files by their plain
names, as TorchServe puts the model folder on the path.

Each archive's own modules are imported with only its folder on the path and taken out of
``sys.modules`` afterwards, so two archives that both ship ``model.py`` each get their own.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

_PACKAGE = __name__.rsplit(".", 1)[0]
STAND_INS = {"ts": f"{_PACKAGE}.ts"}
VISION = {"torchvision": f"{_PACKAGE}.vision"}
_LOCK = threading.Lock()
"""One archive's imports at a time: the path and ``sys.modules`` are the process's."""


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
    """Run an archive's imports: its folder first on the path, its module names free of any
    other archive's, torchvision's transforms stood in for when torchvision is absent. The
    modules it imported from its folder go into ``owned`` and out of ``sys.modules``."""
    install_stand_ins()
    names = {p.stem for p in folder.glob("*.py")} | {
        p.name for p in folder.iterdir() if (p / "__init__.py").is_file()
    }
    vision = None if importlib.util.find_spec("torchvision") else _StandIns(VISION)
    with _LOCK:
        stashed = {n: m for n, m in sys.modules.items() if n.split(".")[0] in names}
        for name in stashed:
            del sys.modules[name]
        sys.path.insert(0, str(folder))
        if vision is not None:
            sys.meta_path.insert(0, vision)
        importlib.invalidate_caches()
        try:
            yield
        finally:
            sys.path.remove(str(folder))
            if vision is not None:
                sys.meta_path.remove(vision)
                for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
                    del sys.modules[name]
            for name in [n for n in sys.modules if n.split(".")[0] in names]:
                owned[name] = sys.modules.pop(name)
            sys.modules.update(stashed)
