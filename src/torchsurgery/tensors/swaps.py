"""Swapping new content into a module's tensors, all or nothing: what conversions and loads run on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from torchsurgery._swap import swap_blocker, swap_in

__all__ = ["Swap", "swap_all", "own_weakrefs_released", "converted"]


@contextlib.contextmanager
def own_weakrefs_released(module: nn.Module) -> Iterator[None]:
    """Drop the weak references RNN modules keep to their own weights while we swap them.

    ``nn.RNNBase`` keeps ``_flat_weight_refs`` (weakrefs to its parameters), which
    ``swap_tensors`` refuses; PyTorch's own ``_apply`` clears and rebuilds them likewise.
    """
    rnns = [m for m in module.modules() if isinstance(m, nn.RNNBase)]
    for rnn in rnns:
        rnn._flat_weight_refs = []
    try:
        yield
    finally:
        for rnn in rnns:
            rnn._init_flat_weights()


def converted(t: torch.Tensor, device: torch.device | None, dtype: torch.dtype | None, non_blocking: bool) -> torch.Tensor:
    target_dtype = dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else t.dtype
    if t.is_meta and device is not None and device.type != "meta":
        # nothing to copy out of a meta tensor: allocate, as Module.to_empty does
        return torch.empty_like(t, device=device, dtype=target_dtype)
    return t.detach().to(device=device or t.device, dtype=target_dtype, non_blocking=non_blocking)


class Swap(NamedTuple):
    """One tensor to swap new content into, and where its gradient goes along."""

    name: str
    tensor: torch.Tensor
    new: torch.Tensor  # after the swap, this object holds the tensor's old content
    device: torch.device | None
    dtype: torch.dtype | None


def swap_all(plan: list[Swap], non_blocking: bool, what: str, *, undo: bool = False) -> None:
    """Swap every new content in, converting gradients along; all or nothing.

    An ``undo`` goes through where the graph of a live output holds a tensor (see ``swap_in``).
    """
    for item in plan:
        problem = swap_blocker(item.name, item.tensor, item.new, what, pending_backward_ok=undo)
        if problem:
            raise RuntimeError(problem)
    done: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    try:
        for name, t, new, device, dtype in plan:
            grad = t.grad
            if grad is not None:
                t.grad = None  # the grad slot counts as a holder for swap_tensors
            try:
                swap_in(t, new, pending_backward_ok=undo)
            except Exception as exc:
                if grad is not None:
                    t.grad = grad
                raise RuntimeError(f"{what}: swapping {name!r} failed: {exc}") from exc
            done.append((t, new, grad))
            if grad is not None:
                t.grad = converted(grad, device, dtype, non_blocking)
    except BaseException:
        for t, old, grad in reversed(done):
            t.grad = None
            swap_in(t, old, pending_backward_ok=undo)
            t.grad = grad
        raise


