"""Putting new data into an existing tensor object: what ``swap_tensors`` needs and refuses.

Shared by the pillars that keep a parameter's identity while changing its data (tensors,
offloading).
"""

from __future__ import annotations

import copyreg
import weakref

import torch
from torch import nn

__all__ = ["wrap_like", "swap_blocker"]


def wrap_like(original: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` as an object of ``original``'s kind, ready to be swapped into it."""
    data = data.detach()
    if type(original) is nn.Parameter or (
        isinstance(original, nn.Parameter) and not issubclass(type(original), nn.Parameter)
    ):
        # plain Parameters, and tensor subclasses marked as parameters (_is_param)
        return nn.Parameter(data, requires_grad=original.requires_grad)
    if isinstance(original, nn.Parameter):
        # a Parameter subclass: same class and attributes, so the swap changes neither
        new = torch.Tensor._make_subclass(type(original), data, original.requires_grad)
        new.__dict__.update(original.__dict__)
        return new
    if data.requires_grad != original.requires_grad and data.is_leaf:
        data.requires_grad_(original.requires_grad)
    return data


def swap_blocker(name: str, tensor: torch.Tensor, replacement: torch.Tensor | None, what: str) -> str | None:
    """Why ``swap_tensors(tensor, replacement)`` would fail or poison autograd, if it would."""
    if weakref.getweakrefs(tensor):
        return (
            f"{what}: cannot swap {name!r}: it has weak references (e.g. a WeakTensorKeyDictionary "
            "or a weakref.ref held somewhere); drop them and try again"
        )
    if replacement is not None:
        slots_now = set(copyreg._slotnames(type(tensor)))  # type: ignore[attr-defined]
        slots_new = set(copyreg._slotnames(type(replacement)))  # type: ignore[attr-defined]
        if slots_now != slots_new:
            return (
                f"{what}: cannot swap {name!r}: its class {type(tensor).__name__} and the converted "
                f"{type(replacement).__name__} have different __slots__; convert with a subclass-aware "
                "__torch_dispatch__ that keeps the class"
            )
    uses = tensor._use_count()  # type: ignore[attr-defined]
    if uses > 1:
        # One use is the object itself; an extra one is a view's base reference, another
        # holder in C++, or the AccumulateGrad node of a graph whose backward is pending,
        # which swap_tensors would poison so that the backward fails much later.
        return (
            f"{what}: cannot swap {name!r}: it is held elsewhere ({uses} holders): by the graph of a "
            "forward whose backward has not run yet (or whose outputs are still alive), or by a view "
            "of it. Run backward and drop the outputs (del loss), and delete views of the tensor"
        )
    return None
