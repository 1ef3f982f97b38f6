"""Choosing what stays resident by which transfers cannot be hidden, not by bytes.

With prefetch, a streamed group's transfer overlaps the compute of the groups before it.
Its *stall* is the part of the transfer that does not fit under that compute. Keeping a
group resident removes its transfer (and its stall) but costs budget. Peers fill the budget
greedily in order or by size; :func:`plan_residency` instead keeps the groups that remove
the most stall per byte, re-simulating after each choice, and :func:`simulate` gives the
step time of any choice under a simple model: ``max(compute, transfer)`` per overlapped
window, the link shared in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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


def plan_residency(groups: Sequence[GroupCost], budget: int, bandwidth: float, prefetch: int = 1) -> list[str]:
    """Groups to keep resident within ``budget`` bytes, chosen to remove the most stall.

    The budget must also leave room for the groups in flight: ``prefetch + 1`` times the
    largest streamed group. A model that fits entirely is kept entirely.

    Example:
        >>> g = [GroupCost("a", 100, 1.0), GroupCost("b", 300, 0.1), GroupCost("c", 100, 5.0), GroupCost("d", 100, 5.0)]
        >>> plan_residency(g, budget=550, bandwidth=100.0)  # b's 3 s transfer hides behind 1 s only
        ['b']
    """
    if sum(g.nbytes for g in groups) <= budget:
        return [g.name for g in groups]
    resident: list[str] = []
    while True:
        streamed = [g for g in groups if g.name not in resident]
        if not streamed:
            return resident
        _, stall = simulate(groups, resident, bandwidth, prefetch)
        if stall <= 0:
            return resident
        best, best_gain = None, 0.0
        for candidate in streamed:
            keep = resident + [candidate.name]
            rest = [g.nbytes for g in streamed if g.name != candidate.name]
            in_flight = (prefetch + 1) * max(rest, default=0)
            if sum(g.nbytes for g in groups if g.name in keep) + in_flight > budget:
                continue
            gain = (stall - simulate(groups, keep, bandwidth, prefetch)[1]) / max(candidate.nbytes, 1)
            if gain > best_gain:
                best, best_gain = candidate, gain
        if best is None:
            return resident
        resident.append(best.name)


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
