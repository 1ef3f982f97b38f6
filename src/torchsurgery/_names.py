"""Selecting submodules by qualified name: exact names, globs and filters.

Glob rules, shared by every pillar: a pattern is split on ``.``; ``*`` matches any
text inside one component (``layers.*.mlp`` matches ``layers.3.mlp`` but not
``layers.3.inner.mlp``), ``**`` matches any number of components (zero or more),
and ``?``/``[...]`` work as in :mod:`fnmatch`. A name with no wildcard must match
exactly, and a name or glob that matches nothing is an error listing near matches.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable

from torch import nn

from torchsurgery.errors import NoMatchError

ModuleFilter = Callable[[nn.Module, str], bool]
"""A predicate ``(module, qualified_name) -> bool`` selecting submodules."""

_WILDCARDS = frozenset("*?[")


def is_glob(pattern: str) -> bool:
    """Whether ``pattern`` contains a wildcard."""
    return any(ch in _WILDCARDS for ch in pattern)


def _match(patterns: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    if not patterns:
        return not parts
    head, rest = patterns[0], patterns[1:]
    if head == "**":
        return any(_match(rest, parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], head) and _match(rest, parts[1:])


def glob_match(pattern: str, name: str) -> bool:
    """Whether the qualified ``name`` matches ``pattern`` under the rules above.

    Example:
        >>> glob_match("layers.*.mlp", "layers.0.mlp"), glob_match("layers.*", "layers.0.mlp")
        (True, False)
        >>> glob_match("**.mlp", "model.layers.0.mlp")
        True
    """
    if not is_glob(pattern):
        return pattern == name
    return _match(tuple(pattern.split(".")), tuple(name.split(".")) if name else ())


def near_matches(wanted: str, names: list[str], n: int = 5) -> list[str]:
    """Names close to ``wanted``, best first, for "did you mean" messages.

    Wildcards are ignored; when nothing is close, names ending in ``wanted``'s last
    component come instead (``layers.0.mlp`` for ``layrs.*.mlp``).

    Example:
        >>> near_matches("0.wieght", ["0.weight", "0.bias"])
        ['0.weight']
        >>> near_matches("blocks.*.mlp", ["layers.0.mlp", "layers.1.mlp", "head"])
        ['layers.1.mlp', 'layers.0.mlp']
    """
    plain = wanted.replace("*", "").replace("?", "")
    close = difflib.get_close_matches(plain, names, n=n, cutoff=0.5)
    if not close:
        # fall back to names sharing the last component ("mlp" for "layers.*.mlp")
        tail = plain.rsplit(".", 1)[-1]
        close = [name for name in names if tail and name.endswith(tail)][:n]
    return close


def no_match(
    what: str, wanted: str, names: list[str], kind: str = "submodule", advice: str = "", arg: str = ""
) -> NoMatchError:
    """The error for a name or glob that matches none of ``names``, with the near matches.

    ``arg`` names the argument that held ``wanted`` when it is not the caller's main one.

    Example:
        >>> str(no_match("example", "layer.0", ["layers.0", "head"]))
        "example: 'layer.0' matches no submodule of the model; did you mean 'layers.0'?"
    """
    return NoMatchError(what, wanted, near_matches(wanted, names), kind, advice, arg)


def select(
    model: nn.Module, selector: str | ModuleFilter, *, what: str = "torchsurgery"
) -> list[tuple[str, nn.Module]]:
    """The ``(qualified name, module)`` pairs of ``model`` that ``selector`` picks.

    Args:
        model: the root module; its own name is ``""``.
        selector: an exact qualified name, a glob, or a filter ``(module, name) -> bool``.
        what: the caller's name, used in error messages.

    Returns:
        The matches in ``model.named_modules()`` order (each module once).

    Raises:
        TypeError: ``selector`` is neither a string nor a callable.
        NoMatchError: nothing matches (a ``ValueError``); it lists near matches.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> [name for name, _ in select(model, "*")]
        ['0', '1']
    """
    named = list(model.named_modules())
    if isinstance(selector, str):
        found = [(name, m) for name, m in named if glob_match(selector, name)]
        if not found:
            raise no_match(what, selector, [n for n, _ in named if n])
        return found
    if callable(selector):
        found = [(name, m) for name, m in named if selector(m, name)]
        if not found:
            raise ValueError(f"{what}: the filter {selector!r} selects no submodule of the model")
        return found
    raise TypeError(
        f"{what}: expected a module name, a glob or a filter (module, name) -> bool, "
        f"got {type(selector).__name__} {selector!r}"
    )
