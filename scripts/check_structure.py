"""The package's shape, checked by `make lint`: no import cycle and no module too long to read.

import-linter's contracts (pyproject.toml) keep the layers in one direction; a cycle inside one
layer, or one formed by imports inside functions, passes them, so this check walks every import
the package makes (function-level and type-checking imports included) and fails on any cycle.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp

PACKAGE = "nograd"
MAX_LINES = 450
GENERATED = "generated"
"""Folders of generated code (protobuf stubs): not written by hand, so not held to the length."""
TABLES = frozenset({"settings.py", "observability/metrics.py"})
"""Modules that are one table by design (every setting in one class, each field with its
docstring; every metric declared once): splitting them would scatter what a reader looks up in
one place."""


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        # Iterative Tarjan: (module, iterator over its imports) frames instead of recursion.
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        frames: list[tuple[str, Iterable[str]]] = [(root, iter(sorted(graph.get(root, ()))))]
        while frames:
            module, children = frames[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    frames.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[module] = min(low[module], index[child])
            if advanced:
                continue
            frames.pop()
            if frames:
                parent = frames[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1 or module in graph.get(module, ()):
                    cycles.append(sorted(component))
    return cycles


def package_graph(package: str) -> dict[str, set[str]]:
    graph = grimp.build_graph(package, cache_dir=None)
    return {module: graph.find_modules_directly_imported_by(module) for module in graph.modules}


def long_modules(root: Path, limit: int) -> list[tuple[Path, int]]:
    paths = (
        p
        for p in sorted(root.rglob("*.py"))
        if GENERATED not in p.relative_to(root).parts
        and p.relative_to(root).as_posix() not in TABLES
    )
    sizes = ((path, len(path.read_text().splitlines())) for path in paths)
    return [(path, lines) for path, lines in sizes if lines > limit]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-lines", type=int, default=MAX_LINES)
    args = parser.parse_args(argv)
    failed = False
    graph = package_graph(PACKAGE)
    for cycle in import_cycles(graph):
        failed = True
        print(f"import cycle among: {', '.join(cycle)}")
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.origin is not None, f"{PACKAGE} is not installed"
    root = Path(spec.origin).parent
    for path, lines in long_modules(root, args.max_lines):
        failed = True
        where = path.relative_to(root.parent)
        print(f"module too long: {where} has {lines} lines (at most {args.max_lines})")
    if not failed:
        print(f"{PACKAGE}: {len(graph)} modules, no import cycle, none over {args.max_lines} lines")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
