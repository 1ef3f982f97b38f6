"""The package's import graph: pillars import each other without cycles, and no one's privates.

Every module under ``src/torchsurgery`` is parsed with ``ast`` (nothing is imported), and
every import of a package module is collected, including the lazy ones inside functions.
A *pillar* is one of the packages (``flex``, ``distributed``, ``offloading``, ``compact``, ``cli``,
``compat``) or one of the root modules ``patching`` and ``tensors``. The shared private
root modules (``_undo``, ``_names``...) and ``errors`` may be imported by anyone, and
import no pillar. The package root (``torchsurgery/__init__.py``, ``__main__``) gathers the
public API; a pillar using the public API (the command line) may import it, as long as the
root does not import that pillar back. ``__main__`` only starts the command line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "torchsurgery"
PILLARS = {"flex", "distributed", "offloading", "compact", "cli", "compat", "patching", "tensors"}
SHARED = {"_undo", "_names", "_checkpoint", "_format", "_validate", "_tensor_layout", "_swap", "_pytree", "errors"}
ROOT = "<root>"
ENTRY = "__main__"  # ``python -m torchsurgery``: runs the command line, imported by no module

# Violations in the tree today, (importing module, what it reaches), each being removed;
# a fixed one must leave this list, which is to become empty.
ALLOWED_PRIVATE_IMPORTS: set[tuple[str, str]] = set()
ALLOWED_PILLAR_EDGES: set[tuple[str, str]] = set()


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = _module_names()


def _group(module: str) -> str:
    """The pillar, shared module or root a module belongs to."""
    parts = module.split(".")
    return ROOT if len(parts) == 1 else parts[1]


def _imports(module: str, path: Path) -> Iterator[tuple[str, str | None]]:
    """(package module imported, name taken from it or None) for every import in ``module``.

    A module imported under a name counts as importing each ``_private`` attribute read
    through that name (``engine._install`` after ``from torchsurgery.offloading import engine``).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound: dict[str, str] = {}
    for target, name in _import_statements(module, path, tree):
        yield target, name
        if name is None:
            bound[target.rpartition(".")[2]] = target
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                yield bound[node.value.id], node.attr


def _import_statements(module: str, path: Path, tree: ast.Module) -> Iterator[tuple[str, str | None]]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                # "from torchsurgery.flex import model" imports a module; anything else a name
                if f"{base}.{alias.name}" in MODULES:
                    yield f"{base}.{alias.name}", None
                else:
                    yield base, alias.name


def _private_reach(target: str, name: str | None) -> bool:
    """Whether importing ``name`` from ``target`` reaches inside a pillar's privates."""
    below = target.split(".")[2:] + ([name] if name else [])
    return any(part.startswith("_") and not part.startswith("__") for part in below)


def _graph() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """The edges between groups, and the private reaches across pillars."""
    edges: set[tuple[str, str]] = set()
    private: set[tuple[str, str]] = set()
    for module, path in MODULES.items():
        here = _group(module)
        for target, name in _imports(module, path):
            there = _group(target)
            if there != here:
                edges.add((here, there))
            if there in PILLARS and there != here and _private_reach(target, name):
                private.add((module, f"{target}.{name}" if name else target))
    return edges, private


def test_every_pillar_and_shared_module_is_known() -> None:
    groups = {_group(m) for m in MODULES}
    assert groups - PILLARS - SHARED - {ROOT, ENTRY} == set()


def test_shared_modules_import_no_pillar_nor_the_root() -> None:
    edges, _ = _graph()
    assert sorted((a, b) for a, b in edges if a in SHARED and b not in SHARED) == []
    assert sorted((a, b) for a, b in edges if b == ENTRY) == []


def test_no_cycle_between_pillars_and_the_root() -> None:
    edges, _ = _graph()
    nodes = PILLARS | {ROOT}
    pillar_edges = {(a, b) for a, b in edges if a in nodes and b in nodes} - ALLOWED_PILLAR_EDGES
    reach: dict[str, set[str]] = {p: set() for p in nodes}
    for a, b in pillar_edges:
        reach[a].add(b)
    changed = True
    while changed:  # transitive closure
        changed = False
        for p in nodes:
            more = set().union(*(reach[q] for q in reach[p])) - reach[p]
            if more:
                reach[p] |= more
                changed = True
    cycles = sorted(p for p in nodes if p in reach[p])
    assert cycles == [], f"pillars on an import cycle: {cycles}; edges: {sorted(pillar_edges)}"
    stale = sorted(ALLOWED_PILLAR_EDGES - edges)
    assert stale == [], f"gone, remove from ALLOWED_PILLAR_EDGES: {stale}"


def test_no_pillar_imports_another_pillars_private_names() -> None:
    _, private = _graph()
    assert sorted(private - ALLOWED_PRIVATE_IMPORTS) == []
    stale = sorted(ALLOWED_PRIVATE_IMPORTS - private)
    assert stale == [], f"fixed, remove from ALLOWED_PRIVATE_IMPORTS: {stale}"


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("from torchsurgery.offloading.pool import _NoRoom", [("torchsurgery.offloading.pool", "_NoRoom")]),
        ("from ..flex import pytree", [("torchsurgery.flex.pytree", None)]),
        ("from .engine import offload", [("torchsurgery.offloading.engine", "offload")]),
        ("def f():\n    import torchsurgery.flex.model", [("torchsurgery.flex.model", None)]),
        (
            "from torchsurgery.offloading import engine\nengine._install(engine.offload)",
            [("torchsurgery.offloading.engine", None), ("torchsurgery.offloading.engine", "_install")],
        ),
    ],
)
def test_the_parser_sees_every_kind_of_import(tmp_path: Path, source: str, found: list[tuple[str, str | None]]) -> None:
    path = tmp_path / "compat.py"
    path.write_text(source)
    assert list(_imports("torchsurgery.offloading.compat", path)) == found
