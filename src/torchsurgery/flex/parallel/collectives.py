"""The few collectives hook routing needs, on ``torch.distributed`` process groups.

* :func:`gather_along`: concatenate every rank's piece along one dimension, pieces of
  different sizes allowed, differentiably: the backward sums the gradient over the
  group and hands each rank its own slice, because downstream of an edit each rank
  uses only its slice of the edited tensor.
* :func:`gather_to_root`: the same concatenation on the group's first rank only, for
  captures, where nobody else needs the result.
* :func:`agree_on_failure` and :func:`broadcast_from_root`: every rank learns that one
  rank's editing function raised, instead of waiting forever in the next collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torchsurgery.flex.parallel import _wire

__all__ = ["gather_along", "gather_to_root", "agree_on_failure", "broadcast_from_root", "piece_sizes"]


def piece_sizes(local: torch.Tensor, dim: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """The size along ``dim`` of every rank's piece, in group order."""
    n = dist.get_world_size(group)
    mine = torch.tensor([local.shape[dim]], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, mine, group=group)
    return [int(s.item()) for s in sizes]


def _padded(local: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if local.shape[dim] == size:
        return local.contiguous()
    shape = list(local.shape)
    shape[dim] = size - local.shape[dim]
    return torch.cat([local, local.new_zeros(shape)], dim=dim)


def _all_gather(local: torch.Tensor, dim: int, group: dist.ProcessGroup, sizes: list[int]) -> torch.Tensor:
    biggest = max(sizes)
    padded = _padded(local, dim, biggest)
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(pieces, sizes, strict=True)], dim=dim)


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, dim: int, group: dist.ProcessGroup, sizes: list[int]) -> torch.Tensor:
        rank = dist.get_rank(group)
        ctx.dim, ctx.group, ctx.offset, ctx.size = dim, group, sum(sizes[:rank]), sizes[rank]
        return _all_gather(local.detach(), dim, group, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total.narrow(ctx.dim, ctx.offset, ctx.size), None, None, None


def gather_along(local: torch.Tensor, dim: int, group: dist.ProcessGroup, sizes: list[int]) -> torch.Tensor:
    """Every rank's ``local`` piece concatenated along ``dim`` (``sizes`` in group order).

    Differentiable when ``local`` requires grad; the backward is an all-reduce.
    """
    if local.requires_grad and torch.is_grad_enabled():
        result = _GatherAlong.apply(local, dim, group, sizes)
        assert isinstance(result, torch.Tensor)
        return result
    return _all_gather(local, dim, group, sizes)


def gather_to_root(local: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor | None:
    """Equal pieces concatenated along ``dim`` on the group's first rank; ``None`` elsewhere."""
    piece = local.detach().contiguous()
    root = dist.get_rank(group) == 0
    pieces = [torch.empty_like(piece) for _ in range(dist.get_world_size(group))] if root else None
    dist.gather(piece, pieces, group_dst=0, group=group)
    return torch.cat(pieces, dim=dim) if pieces is not None else None


def agree_on_failure(failed: bool, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """The group ranks that failed; every rank of ``group`` must call this."""
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=device)
    if failed:
        flags[dist.get_rank(group)] = 1
    dist.all_reduce(flags, group=group)
    return [i for i, f in enumerate(flags.tolist()) if f]


def broadcast_from_root(
    result: torch.Tensor | None, group: dist.ProcessGroup, device: torch.device
) -> torch.Tensor | None:
    """The group's first rank's ``result`` on every rank; ``None`` everywhere if it had none.

    Shape and dtype travel first, so the result may differ from the input's.
    """
    root = dist.get_rank(group) == 0
    head = torch.zeros(1, dtype=torch.int64, device=device)
    if root:
        packed = _wire.pack([("", result)] if result is not None else [], device=device)
        head[0] = packed.numel()
    dist.broadcast(head, group_src=0, group=group)
    if not root:
        packed = torch.empty(int(head.item()), dtype=torch.uint8, device=device)
    dist.broadcast(packed, group_src=0, group=group)
    _, items = _wire.unpack(packed)
    return items[0][1].clone() if items else None
