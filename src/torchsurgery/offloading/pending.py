"""Graphs that outlive an offload: their backwards give their gradients to the weights given back.

After a forward that recorded gradients, its graph holds what each weight was while offloaded
(the content the offload swapped into the parameter object: kept narrow, on the host, or on
the device where it is resident) through the weight's gradient accumulator, and where it
saved the weight for its backward. ``remove()`` gives every parameter object its own content
back at once, without waiting for such graphs (``with offload(model): y = model(x)`` in grad
mode, ``y`` kept after the block, is how most people run a model). Each graph keeps the
offloaded content it holds, so its backward computes with what its forward computed with; the
gradient that backward accumulates into that content is handed on to the parameter object,
converted to the device and dtype it has then, as the plain model's backward accumulates into
the parameter itself. What the graph keeps is freed with it.
"""

from __future__ import annotations

import functools

import torch

from torchsurgery._swap import swap_in

__all__ = ["hand_over"]


def _held_by_a_graph(tensor: torch.Tensor) -> bool:
    """Whether a graph may accumulate into ``tensor``'s content: a leaf that records gradients with
    another holder than its object (its gradient accumulator, a saved copy, a view)."""
    return tensor.is_leaf and tensor.requires_grad and tensor._use_count() > 1  # type: ignore[attr-defined]


def _hand_on(owner: torch.Tensor, content: torch.Tensor) -> None:
    """After a backward accumulated into ``content`` (what ``owner`` held while offloaded): the
    gradient goes to ``owner``, in its device and dtype, summed as autograd sums into a leaf."""
    grad, content.grad = content.grad, None
    if grad is None:
        return
    grad = grad.to(device=owner.device, dtype=owner.dtype)
    if owner.grad is None:
        owner.grad = grad
    elif torch.is_grad_enabled():  # a backward with create_graph: the sum is part of the new graph
        owner.grad = owner.grad + grad
    else:
        owner.grad += grad


def hand_over(tensor: torch.Tensor, replacement: torch.Tensor) -> None:
    """Swap ``replacement`` (the weight's own content) into ``tensor``, also while graphs hold the
    content swapped out: the gradients their backwards accumulate into it go to ``tensor``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> weight = nn.Parameter(torch.ones(2, dtype=torch.float64))  # as offloaded
        >>> loss = (weight * 3).sum()  # a graph that holds it
        >>> hand_over(weight, nn.Parameter(torch.ones(2)))
        >>> loss.backward()
        >>> weight.dtype, weight.grad
        (torch.float32, tensor([3., 3.]))
    """
    held = _held_by_a_graph(tensor)
    swap_in(tensor, replacement, pending_backward_ok=True, poison=not held)
    if held:  # ``replacement`` holds the content the graph holds now
        # its gradient went to ``tensor`` along with the content: the graph's backward adds to that
        replacement.grad = None
        replacement.register_post_accumulate_grad_hook(functools.partial(_hand_on, tensor))
