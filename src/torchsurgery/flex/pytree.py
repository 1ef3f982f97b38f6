"""Taking the tensors out of whatever a module returns, and putting them back.

Modules return tensors, tuples, lists, dicts, namedtuples, dataclasses and
``transformers`` ``ModelOutput`` objects, nested. :func:`flatten` lists the tensor
leaves in a stable order (depth first, dict order) and gives back a function that
rebuilds the same structure, of the same types, from a list of replacement leaves.

The walk is ``torch.utils._pytree``'s (``transformers`` registers ``ModelOutput`` with it).
This wrapper stays for the rules it lacks, each of which would otherwise need a change to
torch's global registry: only tensors are leaves, and a dataclass or a subclass of
``dict``, ``list`` or ``tuple`` that nobody registered (a leaf to ``_pytree``) is walked too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

Rebuild = Callable[[list[torch.Tensor]], Any]


def flatten(obj: Any) -> tuple[list[torch.Tensor], Rebuild]:
    """The tensor leaves of ``obj`` and a function rebuilding ``obj`` from new leaves.

    Example:
        >>> import torch
        >>> leaves, rebuild = flatten({"a": torch.zeros(1), "b": (torch.ones(1), "text")})
        >>> len(leaves)
        2
        >>> rebuild([torch.full((1,), 5.0), leaves[1]])["a"]
        tensor([5.])
    """
    items, spec = tree_flatten(obj)
    leaves: list[torch.Tensor] = []
    parts: list[tuple[int, Rebuild]] = []  # per pytree leaf: how many tensors it holds, how to rebuild it
    for item in items:
        inner, build = _flatten_leaf(item)
        leaves.extend(inner)
        parts.append((len(inner), build))

    def rebuild(new: list[torch.Tensor]) -> Any:
        rebuilt, start = [], 0
        for count, build in parts:
            rebuilt.append(build(new[start : start + count]))
            start += count
        return tree_unflatten(rebuilt, spec)

    return leaves, rebuild


def _flatten_leaf(item: Any) -> tuple[list[torch.Tensor], Rebuild]:
    """The tensors of one ``_pytree`` leaf: itself (a tensor), a dataclass's fields', or none."""
    if isinstance(item, torch.Tensor):
        return [item], _first
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        names = [f.name for f in dataclasses.fields(item)]
        leaves, rebuild_fields = flatten([getattr(item, name) for name in names])
        return leaves, lambda new: dataclasses.replace(item, **dict(zip(names, rebuild_fields(new), strict=True)))
    if isinstance(item, (dict, list, tuple)):
        return _flatten_container(item)
    return [], lambda new: item


def _flatten_container(item: dict[Any, Any] | list[Any] | tuple[Any, ...]) -> tuple[list[torch.Tensor], Rebuild]:
    """An unregistered subclass of ``dict``, ``list`` or ``tuple``, walked as its base and rebuilt as itself."""
    cls = type(item)
    if isinstance(item, dict):
        keys = list(item)
        leaves, rebuild_values = flatten([item[k] for k in keys])

        def rebuild_dict(new: list[torch.Tensor]) -> Any:
            entries = dict(zip(keys, rebuild_values(new), strict=True))
            try:
                return cls(**entries)
            except TypeError:  # keys that are not names, or a constructor without keywords
                return cls(entries)

        return leaves, rebuild_dict
    leaves, rebuild_items = flatten(list(item))
    return leaves, lambda new: cls(rebuild_items(new))


def _first(leaves: list[torch.Tensor]) -> Any:
    return leaves[0]
