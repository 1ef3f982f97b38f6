"""What an offloaded model reports: bytes, transfers, order, measured costs, prefetch hits, the hint."""

from __future__ import annotations

import torch
from torch import nn

from torchsurgery import OffloadStats, offload


class _Conv(nn.Module):
    """Conv blocks: not matmul layers, so every group goes through the ring."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv1d(4, 4, 3, padding=1), nn.GELU()) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_fresh_statistics_are_zero() -> None:
    s = OffloadStats()
    assert (s.bytes_moved, s.transfers, s.prefetch_hits, s.achieved_gbps, s.execution_order) == (0, 0, 0, 0.0, [])


def test_execution_order_and_the_stall_hint_are_measured() -> None:
    d = 16
    model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) for _ in range(3)])
    handle = offload(model, storage_dtype=torch.float16, dtype=torch.float32, skip=None)
    assert handle.stats().hint == "no streamed group has run yet"
    with torch.no_grad():
        model(torch.randn(2, d))
    assert handle.stats().execution_order == ["0", "1", "2"]  # the order groups actually ran in
    assert handle.stats().hint.startswith(("transfer-bound: ", "compute-bound: "))
    handle.remove()
    assert not model._forward_hooks


def test_counts_follow_the_plan_and_outlive_the_offload() -> None:
    model = _Conv()
    x = torch.randn(2, 4, 8)
    handle = offload(model, storage_dtype=torch.float64, dtype=torch.float32)
    groups = handle.plan.groups
    with torch.no_grad():
        for _ in range(3):
            model(x)
    s = handle.stats()
    assert s.streamed_groups == [g.name for g in groups] and not s.resident_groups
    assert s.bytes_moved == 3 * sum(g.nbytes for g in groups) and s.transfers == 3 * len(groups)
    assert s.execution_order == [g.name for g in groups]
    assert [(c.name, c.nbytes) for c in s.group_costs] == [(g.name, g.nbytes) for g in groups]
    assert all(c.compute_s >= 0 for c in s.group_costs) and s.link_bytes_per_s > 0
    assert s.prefetch_hits + s.prefetch_misses == 3 * len(groups) and s.prefetch_hits > 0
    s.streamed_groups.clear()  # a snapshot: the handle's own lists are untouched
    assert handle.stats().streamed_groups == [g.name for g in groups]
    handle.remove()
    after = handle.stats()
    assert (after.prefetch_hits, after.prefetch_misses, after.bytes_moved) == (s.prefetch_hits, s.prefetch_misses, s.bytes_moved)
