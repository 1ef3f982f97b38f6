"""The ring of device buffers that streamed groups are copied into, on its own."""

from __future__ import annotations

import contextlib

import pytest
import torch

import tardy
from torchsurgery._device import resolve_device
from torchsurgery.offloading.packing import FlatLayout, pack_runs
from torchsurgery.offloading.streams import PackedGroup, Ring


def _groups(n: int) -> tuple[list[PackedGroup], list[list[torch.Tensor]]]:
    weights = [[torch.randn(3, 2) + i, torch.arange(i + 1).half()] for i in range(n)]
    packed = []
    for i, w in enumerate(weights):
        layout = FlatLayout.of(w)
        views = pack_runs(w, layout, lambda n: torch.empty(n, dtype=torch.uint8))
        packed.append(PackedGroup(f"g{i}", layout, tuple(views)))
    return packed, weights


def _same(views: list[torch.Tensor], weights: list[torch.Tensor]) -> bool:
    return all(torch.equal(v.cpu(), w) for v, w in zip(views, weights, strict=True))


@pytest.mark.accelerator
def test_groups_come_in_exactly_and_the_next_ones_are_copied_ahead(accelerator: torch.device) -> None:
    groups, weights = _groups(4)
    with tardy.settings(seed=1, delay=(0.0, 0.001)) if tardy.registered() else contextlib.nullcontext():
        ring = Ring(groups, resolve_device(accelerator, "test"), slots=2)
        for _ in range(2):
            for i, group in enumerate(groups):
                slot, views, _ = ring.enter(group, groups[i + 1 : i + 2])
                assert _same(views, weights[i])
                ring.exit(slot)
        assert ring.misses == 2 and ring.prefetched == 6  # only each pass's first group was not ahead


def test_a_forgotten_group_is_copied_again() -> None:
    groups, weights = _groups(2)
    ring = Ring(groups, resolve_device("cpu", "test"), slots=2)
    slot, _, _ = ring.enter(groups[0], [groups[1]])
    ring.exit(slot)
    ring.forget(groups[1])  # e.g. it became resident
    slot, views, _ = ring.enter(groups[1], [])
    assert ring.misses == 2 and _same(views, weights[1])


@pytest.mark.accelerator
def test_a_slot_still_in_use_is_never_overwritten(accelerator: torch.device) -> None:
    groups, weights = _groups(3)
    with tardy.settings(seed=2) if tardy.registered() else contextlib.nullcontext():
        ring = Ring(groups, resolve_device(accelerator, "test"), slots=1)
        outer, outer_views, _ = ring.enter(groups[0], [groups[1]])  # nothing free to copy ahead into
        inner, inner_views, _ = ring.enter(groups[1], [])  # nested: a temporary buffer
        assert inner == -1 and _same(inner_views, weights[1])
        ring.exit(inner)
        assert _same(outer_views, weights[0])
        ring.exit(outer)
        slot, views, _ = ring.enter(groups[2], [])
        assert slot == outer and _same(views, weights[2])


@pytest.mark.accelerator
def test_on_the_accelerator_a_nested_group_comes_through_a_temporary_buffer_in_stream_order(accelerator: torch.device) -> None:
    groups, weights = _groups(3)  # in pageable memory: asynchronous copies from it too
    with tardy.settings(lazy=True) if tardy.registered() else contextlib.nullcontext():
        ring = Ring(groups, resolve_device(accelerator, "test"), slots=1)
        outer, outer_views, _ = ring.enter(groups[0], [groups[1]])
        inner, inner_views, _ = ring.enter(groups[1], [])  # every slot busy: a temporary buffer
        assert inner == -1 and _same(inner_views, weights[1])  # read on the compute stream
        ring.exit(inner)
        assert _same(outer_views, weights[0])
        ring.exit(outer)
        slot, views, _ = ring.enter(groups[2], [])
        assert _same(views, weights[2])
        ring.exit(slot)
        torch.accelerator.synchronize()
