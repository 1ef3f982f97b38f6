"""Device-independent parts of the streaming engine: packing, order recording, residency planning."""

from __future__ import annotations

import random

import pytest
import torch
from _residency import best_stall, in_order

from torchsurgery.offloading.order import OrderRecorder
from torchsurgery.offloading.packing import ALIGNMENT, FlatLayout, pack, unpack
from torchsurgery.offloading.planner import GroupCost, plan_residency, simulate, stall_hint

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
]


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).view(shape)  # arbitrary bit patterns, NaNs included


def test_pack_unpack_round_trip_is_bit_exact_for_every_dtype() -> None:
    shapes = [(3,), (2, 5), (0,), (1, 1, 7), ()]
    tensors = [_random_tensor(d, shapes[i % len(shapes)]) for i, d in enumerate(DTYPES)]
    layout = FlatLayout.of(tensors)
    buffer = pack(tensors, layout)
    assert buffer.dtype == torch.uint8 and buffer.numel() == layout.nbytes
    assert all(slot.offset % ALIGNMENT == 0 for slot in layout.slots)
    for original, view in zip(tensors, unpack(buffer, layout), strict=True):
        assert view.dtype == original.dtype and view.shape == original.shape
        assert torch.equal(view.view(torch.uint8) if view.numel() else view, original.view(torch.uint8) if original.numel() else original)
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # views, no copies


def test_pack_casts_to_the_layout_dtypes_and_refuses_mismatches() -> None:
    weights = [torch.randn(4, 4), torch.randn(4)]
    layout = FlatLayout.of(weights, [torch.bfloat16, torch.float32])
    views = unpack(pack(weights, layout), layout)
    assert views[0].dtype == torch.bfloat16 and torch.equal(views[0], weights[0].bfloat16())
    assert torch.equal(views[1], weights[1])
    with pytest.raises(ValueError, match="tensors for a layout"):
        pack(weights[:1], layout)
    with pytest.raises(ValueError, match="uint8 buffer"):
        pack(weights, layout, out=torch.empty(8, dtype=torch.uint8))


def test_one_buffer_copy_moves_the_whole_group() -> None:
    weights = [torch.randn(3, 3), torch.randn(3).half()]
    layout = FlatLayout.of(weights)
    host = pack(weights, layout)
    moved = host.clone()  # stands for the single host-to-device copy
    for a, b in zip(weights, unpack(moved, layout), strict=True):
        assert torch.equal(a, b)


def test_order_recorder_prefetches_along_the_recorded_order() -> None:
    order = OrderRecorder()
    assert order.ahead("a", 1) == []  # nothing recorded yet
    first = ["enc.0", "enc.1", "dec.0", "enc.0", "dec.1"]  # a shared block runs twice, out of creation order
    for name in first:
        order.ran(name)
    order.end_forward()
    assert order.recorded == first
    order.ran("enc.0")
    assert order.ahead("enc.0", 2) == ["enc.1", "dec.0"]
    order.ran("enc.1")
    order.ran("dec.0")
    order.ran("enc.0")  # second occurrence: prefetch what followed it last time
    assert order.ahead("enc.0", 1) == ["dec.1"]
    assert order.misses == 0
    order.ran("other")  # out of order: a miss, and the next forward's order is the new one
    order.end_forward()
    assert order.misses == 1 and order.recorded[-1] == "other"
    assert order.ahead("missing", 3) == []


def test_simulation_matches_hand_computed_timelines() -> None:
    groups = [GroupCost("a", 200, 1.0), GroupCost("b", 200, 1.0), GroupCost("c", 200, 1.0)]
    # transfers of 2 s behind 1 s of compute: each later group waits 1 s
    assert simulate(groups, [], bandwidth=100.0) == pytest.approx((7.0, 4.0))
    assert simulate(groups, ["a", "b", "c"], bandwidth=100.0) == pytest.approx((3.0, 0.0))
    fast = simulate(groups, [], bandwidth=1e9)
    assert fast[1] == pytest.approx(0.0, abs=1e-6)


def test_planner_beats_filling_in_order_and_is_near_the_best_choice() -> None:
    rng = random.Random(0)
    ours_total = greedy_total = best_total = 0.0
    for _ in range(60):
        groups = [GroupCost(f"g{i}", rng.randint(50, 400), rng.uniform(0.05, 2.0)) for i in range(6)]
        bandwidth, prefetch = 100.0, 1
        budget = rng.randint(900, 1600)
        ours = plan_residency(groups, budget, bandwidth, prefetch)
        rest = [g.nbytes for g in groups if g.name not in ours]
        assert sum(g.nbytes for g in groups if g.name in ours) + 2 * max(rest, default=0) <= budget or not rest
        ours_stall = simulate(groups, ours, bandwidth, prefetch)[1]
        greedy_stall = simulate(groups, in_order(groups, budget, prefetch), bandwidth, prefetch)[1]
        best = best_stall(groups, budget, bandwidth, prefetch)
        assert ours_stall <= simulate(groups, [], bandwidth, prefetch)[1] + 1e-9
        ours_total, greedy_total, best_total = ours_total + ours_stall, greedy_total + greedy_stall, best_total + best
    assert ours_total < greedy_total  # residency by hidden-ness beats residency by order
    assert ours_total <= 1.10 * best_total  # and comes close to the exhaustive optimum


def test_a_model_that_fits_is_kept_whole_and_the_hint_reads_well() -> None:
    groups = [GroupCost("a", 100, 1.0), GroupCost("b", 300, 1.0)]
    assert plan_residency(groups, budget=400, bandwidth=1.0) == ["a", "b"]
    assert stall_hint(groups, ["a", "b"], bandwidth=100.0).startswith("compute-bound")
    hint = stall_hint(groups, [], bandwidth=100.0)
    assert hint.startswith("transfer-bound: 300 B more residency would hide")
