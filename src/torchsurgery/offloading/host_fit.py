"""The host memory an offload streamed from a checkpoint file needs besides its host tier, and the
finer groups it streams where the host has too little.

Groups read from a checkpoint on every forward pass through a
:class:`~torchsurgery.offloading.file_reader.FileReader`'s read buffers, each as large as the
largest such group (:func:`~torchsurgery.offloading.file_reader.reader_bytes`), and on a CPU a
group whose weights compute in another dtype than the file's is cast at each run, in host
memory. A CPU computes on the read buffers themselves: the ring's slots, reserved there, are not
written for the groups the reader serves, and take no memory (pages never written are not
committed).

Those buffers come first; the host tier keeps groups in what is left. Without a ``host_budget``
of the user's, when they do not fit in the memory available less :data:`~torchsurgery.offloading.host_tier.MARGIN`,
finer groups are streamed (single modules, then one at a time), with one sentence naming the
choice; where nothing finer fits within the margin, the finest is taken if it fits in what is
available at all. Only a single weight too large for that is refused. With a ``host_budget`` of the
user's, the groups are kept as chosen, and refused only where their buffers alone exceed the
memory available now.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torchsurgery._device import OffloadDevice
from torchsurgery._format import human_bytes
from torchsurgery.offloading import host_tier
from torchsurgery.offloading.budgets import streaming_bytes
from torchsurgery.offloading.file_reader import read_buffers, reader_bytes
from torchsurgery.offloading.host_tier import HostAccount, host_budget_of
from torchsurgery.offloading.plan_types import GroupPlan, ParamPlan, PlanOptions, Residency

__all__ = ["Placed", "host_need", "fit_to_host"]

_WHAT = "torchsurgery.offload"

Placed = tuple[list[GroupPlan], PlanOptions, int | None, int | None]
"""A plan placed on the device: its groups, its options, its budget and the budget left for measured residency."""


def _streamed(groups: Iterable[GroupPlan]) -> list[GroupPlan]:
    """The groups read from the checkpoint file while the model runs (not resident)."""
    return [g for g in groups if not g.resident and any(p.residency is Residency.FILE for p in g.params)]


def host_need(groups: Iterable[GroupPlan], prefetch: int, seam: OffloadDevice) -> int:
    """Host bytes the groups streamed from a checkpoint file need besides those the host tier keeps.

    The read buffers of its reader, sized for the largest streamed group's slot (as the ring packs
    it), and on a CPU the copies a run computes on where a group's weights are cast from the file's
    dtype (the largest run's). 0 where no group streams from the file.

    Example:
        >>> import os, tempfile
        >>> from torch import nn
        >>> from safetensors.torch import save_file
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> save_file(model.state_dict(), path)
        >>> plan = torchsurgery.plan_offload(model, storage=path, groups="leaves", host_budget=0)
        >>> layer = 64 * 64 * 4 + 64 * 4  # a layer's bytes: 2 read buffers and 4 threads' direct reads of it, aligned
        >>> host_need(plan.groups, plan.prefetch, plan.offload_device) == 2 * (layer + 4096) + 4 * (layer + 3 * 4096)
        True
    """
    streamed = [(_read_size(g), streaming_bytes(g)[1]) for g in _streamed(groups)]
    if not streamed:
        return 0
    casts = max(r for _, r in streamed) if seam.host_compute else 0
    return reader_bytes(max(s for s, _ in streamed), prefetch, seam.host_compute) + casts


def _read_size(group: GroupPlan) -> int:
    """The bytes of ``group``'s read buffer: its ring slot, or the file's bytes where they are more
    (a group converted to a narrower ``storage_dtype`` as it is read lands as the file stores it)."""
    names = {p.name for p in group.params}
    in_file = sum(p.nbytes // p.compute_dtype.itemsize * (p.file_dtype or p.storage_dtype).itemsize
                  for p in group.params if p.residency is Residency.FILE and (p.tied_to is None or p.tied_to not in names))
    return max(streaming_bytes(group)[0], in_file)


def _file_bytes(p: ParamPlan) -> int:
    """A weight's bytes as the checkpoint stores it."""
    return p.nbytes // p.compute_dtype.itemsize * p.storage_dtype.itemsize


def _need(placed: Placed, room: int) -> int:
    """What ``placed`` needs of the host besides its host tier: nothing where the host tier can keep
    every streamed group within ``room`` (no read on any forward after the first), else :func:`host_need`."""
    groups, options = placed[0], placed[1]
    streamed = _streamed(groups)
    if sum(_file_bytes(p) for g in streamed for p in g.params if p.tied_to is None) <= room:
        return 0
    return host_need(groups, options.prefetch, options.device)


def _largest(placed: Placed) -> GroupPlan:
    """The largest group ``placed`` streams from the file (the one its read buffers are sized for)."""
    return max(_streamed(placed[0]), key=_read_size)


def _needs(placed: Placed, need: int) -> str:
    """``need`` in words: what ``placed``'s groups take to stream from the file."""
    prefetch, host = placed[1].prefetch, placed[1].device.host_compute
    return (
        f"{human_bytes(need, binary=True)} of host memory to stream from the checkpoint at prefetch={prefetch} "
        f"({read_buffers(prefetch, host)} read buffers for its largest group {_largest(placed).name or '<root>'!r})"
    )


def fit_to_host(
    placed: Placed, finer: Iterable[tuple[str, Callable[[], Placed]]], host_budget: int | HostAccount | None,
    report: Callable[[str], None] | None,
) -> tuple[Placed, int]:
    """The plan whose streamed groups the host can hold, and the host bytes its host tier may keep.

    Args:
        placed: the plan as chosen for the device.
        finer: the finer plans to fall back to, coarsest first: each step in words and what plans it.
        host_budget: the host budget (bytes, an account, ``None``: the memory available less the margin).
        report: where the host budget is not the user's, what is told the finer groups taken (one
            sentence); ``None``: the user's, kept as chosen.

    Raises:
        ValueError: with the user's host budget, the chosen groups' buffers alone exceed the memory available now.
        RuntimeError: without, even the largest single module streamed alone does not fit in what is available.
    """
    available = host_tier.available_memory()
    if report is None:  # the user's: the groups as chosen, unless they cannot run at all
        keep = host_budget_of(host_budget)
        need = _need(placed, keep)
        if need > available:
            raise _refused(placed, need, available, keep, finer)
        return placed, keep
    room = max(0, available - host_tier.MARGIN)
    keep = min(host_budget_of(host_budget), room)
    need = _need(placed, keep)
    if need <= room:
        return placed, min(keep, room - need)
    chosen, step = _needs(placed, need), ""
    for taken, make in finer:  # coarsest first, down to single modules one at a time
        step, placed = taken, make()
        need = _need(placed, keep)
        if need <= room:
            break
    if need > available:
        raise _too_small(placed, need, available)
    if step:
        within = "" if need <= room else ", in part of that margin (nothing finer fits without it)"
        report(
            f"its groups need {chosen}, more than the {human_bytes(room, binary=True)} it may take there (the "
            f"{human_bytes(available, binary=True)} available less a {human_bytes(host_tier.MARGIN, binary=True)} "
            f"margin); streaming {step} instead{within}"
        )
    return placed, max(0, min(keep, room - need))


def _refused(
    placed: Placed, need: int, available: int, keep: int, finer: Iterable[tuple[str, Callable[[], Placed]]]
) -> ValueError:
    """The refusal of groups whose buffers alone exceed the memory available, with the user's host budget."""
    steps = list(finer)
    if steps:
        step, make = steps[-1]
        finest = f"stream finer groups ({step}: {human_bytes(_need(make(), keep), binary=True)}), "
    else:
        finest = "(they are single modules one at a time already) "
    return ValueError(
        f"{_WHAT}: its groups need {_needs(placed, need)} besides what the host budget keeps, more than the "
        f"{human_bytes(available, binary=True)} of host memory available now; {finest}free host memory, or leave "
        "host_budget out (the offload then chooses groups the host can hold)"
    )


def _too_small(placed: Placed, need: int, available: int) -> RuntimeError:
    """The refusal of a plan streaming single modules one at a time that the host cannot hold: its largest weight."""
    group = _largest(placed)
    weight = max((p for p in group.params if p.residency is Residency.FILE), key=_file_bytes)
    return RuntimeError(
        f"{_WHAT}: the host has too little memory to stream this checkpoint: its largest single weight "
        f"{weight.name!r} ({_file_bytes(weight)} bytes) needs {need} bytes of host memory streamed alone "
        f"(groups='leaves', prefetch=0: {read_buffers(0, placed[1].device.host_compute)} read buffers for its module {group.name or '<root>'!r}), "
        f"more than the {available} bytes available now; free host memory (close other programs) and offload "
        "again, or save that weight in a narrower dtype"
    )

