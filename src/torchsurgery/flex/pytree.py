"""Taking the tensors out of whatever a module returns, and putting them back.

Modules return tensors, tuples, lists, dicts, namedtuples, dataclasses and
``transformers`` ``ModelOutput`` objects, nested. :func:`flatten` lists the tensor
leaves in a stable order (depth first, dict order) and gives back a function that
rebuilds the same structure, of the same types, from a list of replacement leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

Rebuild = Callable[[list[torch.Tensor]], Any]


def _identity(leaves: list[torch.Tensor]) -> Any:
    return leaves[0]


def _walk(obj: Any, leaves: list[torch.Tensor]) -> Callable[[list[torch.Tensor], int], tuple[Any, int]]:
    """Collect tensor leaves of ``obj``; return ``build(new_leaves, start) -> (obj, next)``."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return lambda new, i: (new[i], i + 1)
    if isinstance(obj, dict):
        # dict, OrderedDict, and transformers' ModelOutput (an OrderedDict subclass)
        keys = list(obj.keys())
        parts = [_walk(obj[k], leaves) for k in keys]
        cls = type(obj)

        def build_dict(new: list[torch.Tensor], i: int) -> tuple[Any, int]:
            values = []
            for part in parts:
                value, i = part(new, i)
                values.append(value)
            items = dict(zip(keys, values, strict=True))
            if cls is dict:
                return items, i
            try:
                return cls(**items), i
            except TypeError:
                return cls(items), i

        return build_dict
    if isinstance(obj, (tuple, list)):
        parts = [_walk(item, leaves) for item in obj]
        seq_cls = type(obj)
        is_namedtuple = isinstance(obj, tuple) and hasattr(obj, "_fields")

        def build_seq(new: list[torch.Tensor], i: int) -> tuple[Any, int]:
            values = []
            for part in parts:
                value, i = part(new, i)
                values.append(value)
            if is_namedtuple:
                return seq_cls(*values), i
            return seq_cls(values), i

        return build_seq
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj)]
        parts = [_walk(getattr(obj, name), leaves) for name in fields]

        def build_dataclass(new: list[torch.Tensor], i: int) -> tuple[Any, int]:
            changes = {}
            for name, part in zip(fields, parts, strict=True):
                changes[name], i = part(new, i)
            return dataclasses.replace(obj, **changes), i

        return build_dataclass
    return lambda new, i: (obj, i)


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
    if isinstance(obj, torch.Tensor):
        return [obj], _identity
    leaves: list[torch.Tensor] = []
    build = _walk(obj, leaves)
    return leaves, lambda new: build(new, 0)[0]
