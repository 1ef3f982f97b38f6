"""Tensor parallelism: the full tensor from each rank's shard, and each rank's shard back.

A ``DTensor`` is gathered with ``full_tensor()`` and redistributed to its placements; a
plain tensor is gathered along the dimension that :mod:`~torchsurgery.flex.parallel.sharding`
finds (from the hook's ``expected_shape``, else from the module's parallelisation plan)
and chunked back. Capture-only hooks gather to the first tensor-parallel rank alone, or
to every rank when each keeps its own capture; editing hooks gather to every rank,
differentiably, so gradients reach every shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from torchsurgery.flex.hook_function import Binding, Shape
from torchsurgery.flex.parallel.collectives import gather_along, gather_to_root
from torchsurgery.flex.parallel.layout import Layout
from torchsurgery.flex.parallel.sharding import dim_from_expected_shape, dim_from_plan
from torchsurgery.flex.shape_hints import HintCheck

__all__ = ["Unsharded", "TensorParallel"]


@dataclass(frozen=True)
class Unsharded:
    """A hook's activation made whole, and how to cut the edited one back.

    Attributes:
        full: the whole tensor; ``None`` on ranks that did not need it (a capture-only
            gather goes to the first tensor-parallel rank alone).
        dim: the sharded dimension of a plain tensor (``None``: not sharded).
        dtensor: the ``DTensor`` the activation was, if it was one.
    """

    full: torch.Tensor | None
    dim: int | None = None
    dtensor: DTensor | None = None


class TensorParallel:
    """Gathers and scatters hook activations over this rank's tensor-parallel group.

    Args:
        layout: this rank's place in the layout and its groups.

    Example:
        On every rank of a layout with ``tp_size == 2``, for a hook whose
        ``expected_shape`` is twice the local width::

            tp = TensorParallel(layout)
            whole = tp.gather(local, binding, module, everywhere=True)
            local_again = tp.scatter(edit(whole.full), whole)
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._plan_dims: dict[int, int | None] = {}  # id(module) -> the dim its plan shards
        self.hints = HintCheck()  # hints that shard nothing: a mismatch is told, not raised

    def shard_dim(self, local: torch.Tensor, binding: Binding, module: nn.Module | None) -> int | None:
        """The dimension ``local`` is sharded on (``None``: whole on every rank)."""
        layout = self.layout
        expected = binding.hook.expected_shape
        if expected is not None and layout.dp_size > 1 and expected:
            expected = (None, *expected[1:])  # the batch entry is the global batch's
        if layout.tp_size == 1:
            self.hints.check(local, expected, binding.key, why="tensor_parallel_size is 1")
            return None
        if expected is not None:
            dim = dim_from_expected_shape(local, expected, binding.name, layout.tp_size)
            if dim is None:
                self.hints.check(local, expected, binding.key, why="the hint names no sharded dimension")
            return dim
        if module is None or binding.hook_type not in ("forward", "full_backward_pre"):
            return None
        key = id(module)
        if key not in self._plan_dims:
            self._plan_dims[key] = dim_from_plan(module, local.dim())
        return self._plan_dims[key]

    def gather(self, local: torch.Tensor, binding: Binding, module: nn.Module | None, *, everywhere: bool) -> Unsharded:
        """The whole activation: on every rank when ``everywhere``, else on the first
        tensor-parallel rank at least (every rank of the group must call this)."""
        layout = self.layout
        if isinstance(local, DTensor):
            return Unsharded(local.full_tensor(), dtensor=local)
        dim = self.shard_dim(local, binding, module)
        if dim is None:
            return Unsharded(local)
        if not everywhere:
            return Unsharded(gather_to_root(local, dim, layout.tp_group), dim)
        return Unsharded(self._gather_everywhere(local, dim), dim)

    def _gather_everywhere(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        # tensor-parallel shards are equal: no sizes to exchange
        return gather_along(local, dim, self.layout.tp_group, [local.shape[dim]] * self.layout.tp_size)

    def scatter(self, edited: torch.Tensor, whole: Unsharded) -> torch.Tensor:
        """This rank's part of ``edited``, placed as the activation ``whole`` came from."""
        if whole.dtensor is not None:
            mesh = whole.dtensor.device_mesh
            replicated = DTensor.from_local(edited, mesh, [Replicate()] * mesh.ndim, run_check=False)
            return replicated.redistribute(mesh, whole.dtensor.placements)
        if whole.dim is not None:
            return edited.chunk(self.layout.tp_size, whole.dim)[self.layout.tp_rank]
        return edited

    def gather_parameter(self, local: torch.Tensor, name: str, expected_shape: Shape | None) -> torch.Tensor:
        """A parameter unsharded: a DTensor's ``full_tensor()``, or gathered by ``expected_shape``."""
        if isinstance(local, DTensor):
            return local.full_tensor()
        if self.layout.tp_size == 1:
            self.hints.check(local, expected_shape, name, why="tensor_parallel_size is 1")
            return local
        dim = dim_from_expected_shape(local, expected_shape, name, self.layout.tp_size)
        if dim is None:
            self.hints.check(local, expected_shape, name, why="the hint names no sharded dimension")
            return local
        return self._gather_everywhere(local, dim)
