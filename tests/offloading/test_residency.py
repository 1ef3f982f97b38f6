"""Choosing resident groups by the stall they remove: the simulation, the planner, the hint."""

from __future__ import annotations

import random

import pytest
from _residency import best_stall, in_order

from torchsurgery.offloading.residency import GroupCost, plan_residency, simulate, stall_hint


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
