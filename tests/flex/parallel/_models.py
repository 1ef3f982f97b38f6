"""Small models for the distributed tests, and their hand-made tensor-parallel versions."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))``: the reference for the column/row-parallel version."""

    def __init__(self, d: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _SumOverRanks(torch.autograd.Function):
    """Megatron's row-parallel reduction: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _CopyToRanks(torch.autograd.Function):
    """Megatron's column-parallel input: identity forward, all-reduce backward (each rank's
    input gradient covers only its shard of the output)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class ColumnParallelLinear(nn.Module):
    """Rows ``rank`` of ``full``'s weight: the output is sharded on the last dimension."""

    def __init__(self, full: nn.Linear, rank: int, world: int, group: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().chunk(world, 0)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().chunk(world, 0)[rank].clone())
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToRanks.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Columns ``rank`` of ``full``'s weight: takes a sharded input, returns the whole output."""

    def __init__(self, full: nn.Linear, rank: int, world: int, group: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().chunk(world, 1)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SumOverRanks.apply(F.linear(x, self.weight), self.group) + self.bias


def tensor_parallel_mlp(reference: MLP, rank: int, world: int, group: Any = None) -> MLP:
    """The same MLP with ``fc1`` column-parallel and ``fc2`` row-parallel over ``world`` ranks
    (of ``group``, default all)."""
    model = MLP(reference.fc1.in_features, reference.fc1.out_features)
    model.fc1 = ColumnParallelLinear(reference.fc1, rank, world, group)  # type: ignore[assignment]
    model.fc2 = RowParallelLinear(reference.fc2, rank, world, group)  # type: ignore[assignment]
    return model


class Stack(nn.Module):
    """``layers`` in a ModuleDict keyed by their index, so a pipeline stage keeps the names."""

    def __init__(self, n: int = 4, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): MLP(d, 2 * d) for i in range(n)})
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = x + layer(x)
        return self.head(x) if hasattr(self, "head") else x


def stage_of(model: Stack, stage: int, stages: int) -> Stack:
    """Keep the layers of ``stage`` (and the head on the last stage); names unchanged."""
    n = len(model.layers)
    per = n // stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != stages - 1:
        del model.head
    return model
