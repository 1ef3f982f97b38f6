"""Backwards still to run through an offload's weights, which its removal must wait for.

After a forward that recorded gradients, the graph holds the offloaded weights until its
backward runs: giving them back then would leave that backward nowhere to put its
gradient. Each such weight's gradient accumulator carries a mark while its backward is
pending; the mark goes when that backward reaches the accumulator, or with the graph.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from torchsurgery.offloading.originals import Original

__all__ = ["PendingBackwards", "WatchBackward"]

_PENDING_KEY = "torchsurgery_offload_pending"


class _Pending:
    """The mark of a pending backward, on the gradient accumulator of the weight ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name


def _backward_ran(pending: weakref.WeakSet[_Pending], mark: weakref.ref[_Pending], grad: Any) -> None:
    found = mark()
    if found is not None:
        pending.discard(found)


class PendingBackwards:
    """The backwards pending through an offload's weights (a copy of the model has none: in no graph).

    Example:
        >>> import torch
        >>> from torchsurgery.offloading.originals import Originals
        >>> weight = torch.ones(2, requires_grad=True)
        >>> ledger = Originals()
        >>> ledger.remember("w", weight)
        >>> pending = PendingBackwards()
        >>> loss = (weight * 2).sum()
        >>> pending.watch(ledger)
        >>> pending.check("remove", "Linear")
        Traceback (most recent call last):
        ...
        RuntimeError: remove: cannot remove the offload of the Linear while a backward through its offloaded weight 'w' is pending: ...
        >>> loss.backward()
        >>> pending.check("remove", "Linear")
    """

    def __init__(self) -> None:
        self._marks: weakref.WeakSet[_Pending] = weakref.WeakSet()

    def __getstate__(self) -> dict[str, Any]:
        # weak references do not pickle, and a copy's weights are new objects, in no graph (a state
        # that is not empty, so that unpickling calls __setstate__)
        return {"_marks": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._marks = weakref.WeakSet()

    def watch(self, originals: Iterable[Original]) -> None:
        """After a forward that recorded gradients: mark the backward it left pending through the
        weights in ``originals``, on their gradient accumulators."""
        for o in originals:
            tensor = o.tensor
            if not tensor.requires_grad or tensor._use_count() < 2:  # type: ignore[attr-defined]
                continue  # in no graph (one holder: the object itself)
            node = torch.autograd.graph.get_gradient_edge(tensor).node
            metadata: dict[str, Any] = node.metadata  # type: ignore[assignment]  # a property, typed as a method
            mark = metadata.get(_PENDING_KEY)
            if mark is None or mark not in self._marks:
                mark = _Pending(o.name)
                metadata[_PENDING_KEY] = mark
                self._marks.add(mark)
                node.register_prehook(functools.partial(_backward_ran, self._marks, weakref.ref(mark)))

    def check(self, what: str, owner: str) -> None:
        """Refuse (for ``what``, removing the offload of the model of class ``owner``) to give back
        weights that the graph of a pending backward accumulates into.

        Raises:
            RuntimeError: a backward through one of the weights is pending.
        """
        found = [mark.name for mark in self._marks][:1]  # names only: the error's traceback keeps its frame's locals
        if found:
            raise RuntimeError(
                f"{what}: cannot remove the offload of the {owner} while a backward through its offloaded "
                f"weight {found[0]!r} is pending: the weight is held elsewhere, by the graph of a forward that "
                "recorded gradients, and giving it back would leave that backward no weight to put its gradient in. "
                "Run the backward (loss.backward()) or drop the graph (del the outputs and the loss), then remove "
                "the offload; nothing was changed"
            )


class WatchBackward:
    """A forward hook on the offloaded model (also when the forward raised): after a forward that
    recorded gradients, marks the backward it left pending through ``originals`` (picklable)."""

    def __init__(self, pending: PendingBackwards, originals: Iterable[Original]) -> None:
        self.pending = pending
        self.originals = originals

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        # a torch.func transform (grad, vjp, jacrev) differentiates by its own levels, not through
        # the weights' gradient accumulators: nothing of autograd's is left pending by its forward
        if torch.is_grad_enabled() and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active():
            self.pending.watch(self.originals)
