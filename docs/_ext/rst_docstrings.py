"""A griffe extension: read the package's reStructuredText touches as Markdown.

The docstrings are Google style with reStructuredText inline markup (the form doctest,
Sphinx and ``help()`` read well). Before mkdocstrings parses them, this turns
``Example:`` into the ``Examples:`` section griffe renders as code, cross-reference roles
(``:func:`~pkg.name```) into inline code, and a paragraph's closing ``::`` (a literal block
follows) into ``:``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", flags=re.MULTILINE)
_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`(~?)([^`]+)`")
_LITERAL = re.compile(r"(\S)::$", flags=re.MULTILINE)


def _role(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def markdown(text: str) -> str:
    """The docstring ``text`` with its reStructuredText touches in Markdown."""
    text = _EXAMPLE.sub(r"\1Examples:", text)
    text = _ROLE.sub(_role, text)
    return _LITERAL.sub(r"\1:", text)


class RstDocstrings(griffe.Extension):
    """Rewrite every docstring once, when its object is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
