"""Which dimension of a tensor-parallel activation is sharded.

Three sources, in this order:

1. the activation is a ``DTensor``: it knows its placements (handled by the routing);
2. the hook's ``expected_shape`` (flex_model's rule): ``None`` entries take the local
   size, and the one dimension where the full size differs from the local one is the
   sharded one;
3. the module was parallelised with ``torch.distributed.tensor.parallel``
   (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``): its plan says how
   its output leaves it (``Shard(-1)`` after a column-parallel layer, whole after a
   row-parallel one, ``Shard(1)`` with sequence parallelism).

With none of these the activation is whole on every tensor-parallel rank (what a block
built of column- and row-parallel layers returns).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard

__all__ = ["dim_from_expected_shape", "dim_from_plan"]


def _normalise(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def dim_from_expected_shape(
    local: torch.Tensor, expected: tuple[int | None, ...] | None, name: str, tp_size: int
) -> int | None:
    """The sharded dimension that ``expected`` (a hook's ``expected_shape``) implies, or ``None``.

    As in flex_model, a dimension whose hinted size differs from the local one is sharded;
    a hint that names no such dimension implies none (whether it fits the activation is
    checked elsewhere, as a hint nothing needs). A hint that names a sharded dimension must
    be right, since the gather follows it.

    Raises:
        ValueError: the hint names a sharded dimension but has the wrong number of
            dimensions, more than one dimension differs, or a full size is not
            ``tp_size`` times the local one.

    Example:
        >>> dim_from_expected_shape(torch.zeros(2, 3, 4), (None, None, 8), "layers.0.mlp", 2)
        2
        >>> dim_from_expected_shape(torch.zeros(2, 3, 4), (None, None, None, None), "layers.0.mlp", 2) is None
        True
    """
    if expected is None:
        return None
    what = f"torchsurgery.FlexModel: {name!r}"
    differ = [i for i, (e, a) in enumerate(zip(expected, local.shape, strict=False)) if e is not None and e != a]
    if not differ:
        return None
    if len(expected) != local.dim():
        raise ValueError(
            f"{what}: expected_shape {list(expected)} has {len(expected)} dimensions but this rank's "
            f"activation has shape {list(local.shape)}; give one entry per dimension (None for any)"
        )
    if len(differ) > 1:
        raise ValueError(
            f"{what}: expected_shape {list(expected)} differs from this rank's shape {list(local.shape)} in "
            f"dimensions {differ}; tensor parallelism shards one dimension"
        )
    dim = differ[0]
    if expected[dim] != local.shape[dim] * tp_size:
        raise ValueError(
            f"{what}: expected_shape[{dim}] is {expected[dim]}, but this rank holds {local.shape[dim]} of it "
            f"with tensor_parallel_size {tp_size} (x{tp_size} = {local.shape[dim] * tp_size}); fix expected_shape"
        )
    return dim


def _partials(hooks: Iterable[Any]) -> list[functools.partial[Any]]:
    """The ``functools.partial`` objects that ``distribute_module`` wraps in its hooks."""
    found = []
    for hook in hooks:
        for cell in getattr(hook, "__closure__", None) or ():
            value = cell.cell_contents
            if isinstance(value, functools.partial):
                found.append(value)
    return found


def dim_from_plan(module: nn.Module, ndim: int) -> int | None:
    """The dimension the module's tensor-parallel plan leaves its (local) output sharded on.

    ``None`` when the module has no plan, or its output leaves it whole or as a DTensor.

    Example:
        >>> dim_from_plan(nn.Linear(2, 2), 2) is None
        True
    """
    for partial in _partials(module._forward_hooks.values()):
        name = getattr(partial.func, "__qualname__", "")
        if not name.endswith("._prepare_output_fn"):
            continue
        if name.startswith("SequenceParallel."):
            (use_local,) = partial.args
            layouts: tuple[Any, ...] = ()
            for pre in _partials(module._forward_pre_hooks.values()):
                if getattr(pre.func, "__qualname__", "").startswith("SequenceParallel."):
                    layouts = pre.args[0]
        elif len(partial.args) == 2:
            layouts, use_local = partial.args
        else:
            continue
        if not use_local or not layouts:
            return None  # a DTensor comes out: it carries its own placements
        placement = layouts[0]
        return _normalise(placement.dim, ndim) if isinstance(placement, Shard) else None
    return None
