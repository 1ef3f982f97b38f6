"""Every function in ``src/`` fits on a screen (under 60 lines) and every class under 250 lines.

Decorators and docstrings count. A longer one is split along what it does, not by moving
lines into numbered parts.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
FUNCTION_LIMIT = 60
CLASS_LIMIT = 250


def _lengths(tree: ast.AST, prefix: str = "") -> list[tuple[str, str, int]]:
    """(kind, qualified name, lines) of every function and class in ``tree``, nested ones too."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            found.append((kind, name, (node.end_lineno or node.lineno) - start + 1))
            found += _lengths(node, name + ".")
        else:
            found += _lengths(node, prefix)
    return found


def _too_long() -> dict[tuple[str, str], int]:
    limits = {"function": FUNCTION_LIMIT, "class": CLASS_LIMIT}
    return {
        (path.relative_to(SRC).as_posix(), name): lines
        for path in sorted(SRC.rglob("*.py"))
        for kind, name, lines in _lengths(ast.parse(path.read_text(encoding="utf-8")))
        if lines >= limits[kind]
    }


def test_every_function_is_under_60_lines_and_every_class_under_250() -> None:
    assert _too_long() == {}


def test_lengths_count_decorators_docstrings_and_nested_functions() -> None:
    source = "class A:\n    @property\n    def f(self):\n        '''doc'''\n        def g():\n            return 1\n        return g\n"
    assert _lengths(ast.parse(source)) == [("class", "A", 7), ("function", "A.f", 6), ("function", "A.f.g", 2)]
