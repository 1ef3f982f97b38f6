"""Choosing what stays resident by which transfers cannot be hidden, not by bytes.

With prefetch, a streamed group's transfer overlaps the compute of the groups before it.
Its *stall* is the part of the transfer that does not fit under that compute. Keeping a
group resident removes its transfer (and its stall) but costs budget. Peers fill the budget
greedily in order or by size; :func:`plan_residency` instead chooses the groups by the stall
they remove: among a few groups it tries every choice that fits; among many, it adds groups
one at a time (by stall removed per byte, and by stall removed) and keeps the better
outcome. :func:`simulate` gives the step time of any choice under a simple model:
``max(compute, transfer)`` per overlapped window, the link shared in order.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from torchsurgery._format import human_bytes


@dataclass(frozen=True)
class GroupCost:
    """What a group costs per forward: bytes to bring in, and seconds of compute."""

    name: str
    nbytes: int
    compute_s: float


def simulate(groups: Sequence[GroupCost], resident: Iterable[str], bandwidth: float, prefetch: int = 1) -> tuple[float, float]:
    """Step time and total stall of one forward in execution order.

    Transfers run one at a time on the link, each starting as soon as the link is free
    and its group is at most ``prefetch`` groups ahead of the one computing; a group
    computes once its weights are in and the previous group finished.

    Example:
        >>> g = [GroupCost("a", 100, 1.0), GroupCost("b", 300, 1.0)]
        >>> simulate(g, [], bandwidth=100.0)  # b's 3 s transfer overlaps a's 1 s of compute
        (5.0, 3.0)
        >>> simulate(g, ["b"], bandwidth=100.0)
        (3.0, 1.0)
    """
    keep = set(resident)
    link_free = 0.0
    compute_end = 0.0
    finished: list[float] = []  # compute end time of each group
    stall = 0.0
    for i, group in enumerate(groups):
        ready = 0.0
        if group.name not in keep:
            # may start once the group `prefetch` places earlier has started computing
            gate = finished[i - prefetch - 1] if i - prefetch - 1 >= 0 else 0.0
            start = max(link_free, gate)
            link_free = start + group.nbytes / bandwidth
            ready = link_free
        begin = max(compute_end, ready)
        stall += begin - compute_end
        compute_end = begin + group.compute_s
        finished.append(compute_end)
    return compute_end, stall


_EXHAUSTIVE = 10  # up to this many groups, every choice is tried (2**10 simulations)


def _fits(groups: Sequence[GroupCost], keep: Iterable[str], budget: int, prefetch: int) -> bool:
    """Whether ``keep`` resident leaves room for ``prefetch + 1`` of the largest streamed group."""
    kept = set(keep)
    rest = [g.nbytes for g in groups if g.name not in kept]
    return sum(g.nbytes for g in groups if g.name in kept) + (prefetch + 1) * max(rest, default=0) <= budget


def _greedy(
    groups: Sequence[GroupCost], fits: Callable[[Sequence[str]], bool], bandwidth: float, prefetch: int, per_byte: bool
) -> list[str]:
    """Add the group removing the most stall (per byte, or in all) while one fits and helps."""
    resident: list[str] = []
    while True:
        _, stall = simulate(groups, resident, bandwidth, prefetch)
        best, best_gain = None, 0.0
        for candidate in (g for g in groups if g.name not in resident):
            keep = resident + [candidate.name]
            if not fits(keep):
                continue
            gain = stall - simulate(groups, keep, bandwidth, prefetch)[1]
            if per_byte:
                gain /= max(candidate.nbytes, 1)
            if gain > best_gain:
                best, best_gain = candidate, gain
        if best is None or stall <= 0:
            return resident
        resident.append(best.name)


def plan_residency(
    groups: Sequence[GroupCost],
    budget: int,
    bandwidth: float,
    prefetch: int = 1,
    *,
    fits: Callable[[Sequence[str]], bool] | None = None,
) -> list[str]:
    """Groups to keep resident within ``budget`` bytes, chosen to remove the most stall.

    The budget must also leave room for the groups in flight: ``prefetch + 1`` times the
    largest streamed group. A model that fits is kept entirely. ``fits`` (the names kept
    resident -> whether that fits) replaces this account with the caller's (an offload
    counts ring slots, casts and allocations as the device holds them).

    Example:
        >>> g = [GroupCost("a", 100, 1.0), GroupCost("b", 300, 0.1), GroupCost("c", 100, 5.0), GroupCost("d", 100, 5.0)]
        >>> plan_residency(g, budget=550, bandwidth=100.0)  # b's 3 s transfer hides behind 1 s only
        ['b']
    """
    fits = fits or functools.partial(_fits, groups, budget=budget, prefetch=prefetch)
    names = [g.name for g in groups]
    if fits(names):
        return names
    if len(groups) <= _EXHAUSTIVE:
        choices: Iterable[Sequence[str]] = (
            list(keep) for r in range(len(names) + 1) for keep in itertools.combinations(names, r)
        )
    else:
        choices = [_greedy(groups, fits, bandwidth, prefetch, per_byte) for per_byte in (True, False)]
    best: list[str] = []
    best_stall = simulate(groups, [], bandwidth, prefetch)[1]
    for keep in choices:
        if best_stall <= 0:
            break
        if not fits(keep):
            continue
        stall = simulate(groups, keep, bandwidth, prefetch)[1]
        if stall < best_stall - 1e-12:  # strictly better: among equals, the fewest groups (tried first)
            best, best_stall = list(keep), stall
    return best


def stall_hint(groups: Sequence[GroupCost], resident: Iterable[str], bandwidth: float, prefetch: int = 1) -> str:
    """A plain sentence on whether a forward is transfer-bound and what residency would buy.

    Example:
        >>> g = [GroupCost("a", 100, 1.0), GroupCost("b", 300, 1.0)]
        >>> stall_hint(g, [], bandwidth=100.0)
        'transfer-bound: 300 B more residency would hide 67% of the 3.00 s stall'
    """
    resident = list(resident)
    _, stall = simulate(groups, resident, bandwidth, prefetch)
    if stall <= 1e-12:
        return "compute-bound: every transfer is hidden behind compute"
    streamed = [g for g in groups if g.name not in resident]
    costliest = max(streamed, key=lambda g: g.nbytes / bandwidth - g.compute_s)
    _, after = simulate(groups, resident + [costliest.name], bandwidth, prefetch)
    hidden = 100.0 * (stall - after) / stall
    return f"transfer-bound: {human_bytes(costliest.nbytes)} more residency would hide {hidden:.0f}% of the {stall:.2f} s stall"
