"""Trainable modules across ranks: one starting point, one gradient.

Every rank holds its own copy of a module registered with
``FlexModel.register_trainable_module``. The copies start equal (broadcast from the
layout's first rank), and each parameter's gradient is summed over the ranks of the
pipeline stage, because each rank's gradient covers only its tensor-parallel shard and
its own batch rows, then divided by the data-parallel size, as DDP averages the model's
own gradients (see :func:`~torchsurgery.flex.parallel.edits.replica_scale`). Every rank then
holds the gradient one process would compute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from torchsurgery.flex.parallel.layout import Layout

__all__ = ["TrainableGradients"]


class TrainableGradients:
    """Keeps the trainable modules of one wrapper in step over the layout's ranks.

    Args:
        layout: this rank's place in the layout and its groups.

    Example:
        On every rank, in the same order::

            grads = TrainableGradients(layout)
            grads.prepare(probe)   # copies rank 0's values; gradients summed from now on
            ...
            grads.close()          # the gradient hooks come off
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._handles: list[RemovableHandle] = []

    def prepare(self, module: nn.Module) -> None:
        """Start every rank's copy of ``module`` equal; sum its gradients over the stage."""
        layout = self.layout
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=layout.ranks[0], group=layout.group)
        for param in module.parameters():
            if param.requires_grad:
                self._handles.append(param.register_hook(self._sum_over_stage))

    def _sum_over_stage(self, grad: torch.Tensor) -> torch.Tensor:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=self.layout.stage_group)
        return total / self.layout.dp_size if self.layout.dp_size > 1 else total

    def close(self) -> None:
        """Remove the gradient hooks put on trainable modules."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
