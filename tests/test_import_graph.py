"""The package's rooms and their doors: no cycle, no private name across modules, no import-time registration.

Every module under ``src/torchsurgery`` is parsed with ``ast`` (nothing is imported), and
every import of a package module is collected, including the lazy ones inside functions.

A *room* is one concept of the package, and its folder (or module) says what it decides:

* ``patching``: what a module instance does;
* ``tensors``: which tensors a module holds (conversion and loading in place);
* ``offloading``: where weights live and when they move (the plan, the residency solver,
  the engine, streams, packing, the pool, ``DynamicSwapInstaller``);
* ``compact``: how a weight is stored narrower than it computes (the tensor, its products,
  the native kernel);
* ``flex``: what flows through a model, with its parallel backend in ``flex.parallel``;
* ``cli``: the command line; ``compat``: drop-in replacements for other projects' modules.

A room's *door* is its package (``torchsurgery.offloading``, ``torchsurgery.flex.parallel``):
another room imports only from a door, never one of the room's modules. The shared private
root modules (``_undo``, ``_names``, ``_device`` (the one device seam)...) and ``errors`` may be
imported by anyone and import no room. The package root gathers the public API; the command line may use it, as long as the
root does not import it back. ``__main__`` only starts the command line.

Across modules, no name with a leading underscore is imported; a private *module*
(``flex.parallel._wire``) is imported only from inside the package that holds it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "torchsurgery"
ROOMS = {"flex", "offloading", "compact", "cli", "compat", "patching", "tensors"}
SHARED = {"_undo", "_names", "_checkpoint", "_format", "_validate", "_tensor_layout", "_swap", "_device", "errors"}
ROOT = "<root>"
ENTRY = "__main__"  # ``python -m torchsurgery``: runs the command line, imported by no module

# What a module may do at import besides defining names: (module, statement or decorator).
IMPORT_TIME_ALLOWED = {
    # ``python -m torchsurgery`` takes Ctrl-C before torch is imported; a plain import does nothing
    ("torchsurgery", "_command_start()"),
}
# Decorators that run at import; an operator is declared where it is defined (torch.library's way,
# and dynamo must know it before it traces a graph that calls it).
DECORATORS_ALLOWED = {
    "dataclass",
    "contextlib.contextmanager",
    "property",
    "staticmethod",
    "classmethod",
    "abc.abstractmethod",
    "overload",
    "functools.cache",
    "torch.library.custom_op",
    "register_fake",
}


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = _module_names()
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def _group(module: str) -> str:
    """The room, shared module or root a module belongs to."""
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


def _is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _private_reach(module: str, target: str, name: str | None) -> bool:
    """Whether ``module`` importing ``name`` from ``target`` takes another module's private."""
    if target == module:
        return False
    if name is not None and _is_private(name):
        return True
    parts = target.split(".")
    for i, part in enumerate(parts[1:], 1):
        holder = ".".join(parts[:i])  # the package that holds the private module
        if _is_private(part) and not (module == holder or module.startswith(holder + ".")):
            return True
    return False


def _graph() -> tuple[set[tuple[str, str]], set[tuple[str, str]], set[tuple[str, str]]]:
    """The edges between groups, the private reaches, and the imports that bypass a door."""
    edges: set[tuple[str, str]] = set()
    private: set[tuple[str, str]] = set()
    bypass: set[tuple[str, str]] = set()
    for module, path in MODULES.items():
        here = _group(module)
        for target, name in _imports(module, path):
            there = _group(target)
            if there != here:
                edges.add((here, there))
                if there in ROOMS and target not in PACKAGES and len(target.split(".")) > 2:
                    bypass.add((module, target))
            if _private_reach(module, target, name):
                private.add((module, f"{target}.{name}" if name else target))
    return edges, private, bypass


def test_every_room_and_shared_module_is_known() -> None:
    groups = {_group(m) for m in MODULES}
    assert groups - ROOMS - SHARED - {ROOT, ENTRY} == set()
    assert ROOMS - groups == set(), "a room named here is gone from the package"


def test_shared_modules_import_no_room_nor_the_root() -> None:
    edges, _, _ = _graph()
    assert sorted((a, b) for a, b in edges if a in SHARED and b not in SHARED) == []
    assert sorted((a, b) for a, b in edges if b == ENTRY) == []


def test_no_cycle_between_rooms_and_the_root() -> None:
    edges, _, _ = _graph()
    nodes = ROOMS | {ROOT}
    room_edges = {(a, b) for a, b in edges if a in nodes and b in nodes}
    reach: dict[str, set[str]] = {p: set() for p in nodes}
    for a, b in room_edges:
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
    assert cycles == [], f"rooms on an import cycle: {cycles}; edges: {sorted(room_edges)}"


# The command's own top-level modules (``src/*.py``): they import the standard library first
COMMAND_MODULES = {path.stem: path for path in sorted(SRC.glob("*.py"))}


def _module_edges() -> dict[str, set[str]]:
    """Every module of the package and the command, and the modules it imports (lazy imports too)."""
    edges: dict[str, set[str]] = {}
    for module, path in {**MODULES, **COMMAND_MODULES}.items():
        targets = edges.setdefault(module, set())
        targets.update(t for t, _ in _imports(module, path) if t in MODULES and t != module)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            targets.update(n for n in names if n in COMMAND_MODULES and n != module)
    return edges


def test_no_module_is_on_an_import_cycle() -> None:
    # lazy imports count: a cycle through one still ties the two modules to each other
    edges = _module_edges()
    reach = {m: set(t) for m, t in edges.items()}
    changed = True
    while changed:  # transitive closure
        changed = False
        for m in reach:
            more = set().union(*(reach[t] for t in reach[m] if t in reach)) - reach[m]
            if more:
                reach[m] |= more
                changed = True
    cycles = sorted(m for m in reach if m in reach[m])
    assert cycles == [], f"modules on an import cycle: {cycles}"


def test_no_module_imports_another_modules_private_names() -> None:
    _, private, _ = _graph()
    assert sorted(private) == []


def test_rooms_are_entered_by_their_doors() -> None:
    _, _, bypass = _graph()
    assert sorted(bypass) == []


def _import_time_actions(module: str, path: Path) -> Iterator[str]:
    """Each top-level call and decorator that runs when ``module`` is imported."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            yield ast.unparse(node.value)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for decorator in node.decorator_list:
                called = decorator.func if isinstance(decorator, ast.Call) else decorator
                text = ast.unparse(called)
                if text not in DECORATORS_ALLOWED and text.rpartition(".")[2] not in DECORATORS_ALLOWED:
                    yield "@" + text


def test_no_module_registers_anything_when_imported() -> None:
    found = {(m, action) for m, path in MODULES.items() for action in _import_time_actions(m, path)}
    assert sorted(found - IMPORT_TIME_ALLOWED) == []


def test_importing_the_package_registers_no_parallel_routing() -> None:
    # flex builds its own parallel backend when a wrapper asks for ranks; nothing is
    # registered by importing torchsurgery, so a user's registration is the only one
    code = (
        "import torchsurgery\n"
        "from torchsurgery.flex import register_parallel_routing\n"
        "print(register_parallel_routing(lambda request: None) is None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("from torchsurgery.offloading.pool import _NoRoom", [("torchsurgery.offloading.pool", "_NoRoom")]),
        ("from ..flex import routing", [("torchsurgery.flex.routing", None)]),
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


@pytest.mark.parametrize(
    ("module", "target", "name", "private"),
    [
        ("torchsurgery.offloading.engine", "torchsurgery.offloading.streams", "_GroupStreamer", True),
        ("torchsurgery.offloading.engine", "torchsurgery.offloading.streams", "GroupStreamer", False),
        ("torchsurgery.flex.parallel.shipping", "torchsurgery.flex.parallel._wire", None, False),
        ("torchsurgery.cli.store", "torchsurgery.flex.parallel._wire", None, True),
        ("torchsurgery.cli.store", "torchsurgery._undo", "record", False),
        ("torchsurgery.patching", "torchsurgery._undo", "_LOG_KEY", True),
    ],
)
def test_what_counts_as_a_private_reach(module: str, target: str, name: str | None, private: bool) -> None:
    assert _private_reach(module, target, name) is private


def test_import_time_actions_are_seen(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("import x\nx.register(1)\n@dataclass\nclass A: ...\n@x.hook(2)\ndef f(): ...\n")
    assert list(_import_time_actions("m", path)) == ["x.register(1)", "@x.hook"]
