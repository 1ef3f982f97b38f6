"""Reference residency choices the planner is compared with (shared by the planner tests)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from torchsurgery.offloading.residency import GroupCost, simulate


def in_order(groups: list[GroupCost], budget: int, prefetch: int) -> list[str]:
    """What peers do: keep groups resident in execution order while they fit."""
    room = budget - (prefetch + 1) * max(g.nbytes for g in groups)
    chosen = []
    for g in groups:
        if g.nbytes <= room:
            chosen.append(g.name)
            room -= g.nbytes
    return chosen


def best_stall(
    groups: list[GroupCost], budget: int, bandwidth: float, prefetch: int, fits: Callable[[set[str]], bool] | None = None
) -> float:
    """The smallest stall of any residency choice that fits ``budget`` (exhaustive).

    ``fits`` (the names kept resident -> whether that fits) replaces the plain count (the
    groups kept, and ``prefetch + 1`` of the largest streamed one) with an offload's own.
    """
    best = simulate(groups, [], bandwidth, prefetch)[1]
    for r in range(1, len(groups) + 1):
        for keep in itertools.combinations([g.name for g in groups], r):
            rest = [g.nbytes for g in groups if g.name not in keep]
            used = sum(g.nbytes for g in groups if g.name in keep) + (prefetch + 1) * max(rest, default=0)
            if (fits(set(keep)) if fits is not None else used <= budget):
                best = min(best, simulate(groups, keep, bandwidth, prefetch)[1])
    return best
