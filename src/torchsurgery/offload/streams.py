"""Streaming packed groups through a small ring of reusable device buffers.

Each streamed group's weights live in one flat host buffer (pinned when the device is a
GPU): the parameters themselves are views into it, so it is the only host copy. Before
a group runs, its buffer is copied in one transfer into a free slot of a ring of device
buffers and the modules get views of that slot (cast to the compute dtype on the
device when the storage dtype differs). While a group computes, the next groups along
the recorded execution order are copied into other slots on a side stream, each copy
ordered after the last use of its slot by events, so results are exactly those of the
resident model. On a CPU the same machinery runs with plain synchronous copies.

Forwards that record gradients do not use the ring (autograd keeps the weights it saved
until backward, and a slot would be overwritten by then); they convert from the host
buffer directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchsurgery.offload.packing import FlatLayout, unpack


@dataclass(eq=False)
class PackedGroup:
    """A group's weights in one flat host buffer."""

    name: str
    layout: FlatLayout
    host: torch.Tensor


class Ring:
    """``slots`` device buffers, each big enough for the largest packed group.

    Example:
        >>> import torch
        >>> from torchsurgery.offload.packing import FlatLayout, pack
        >>> weights = [torch.arange(3.0)]
        >>> layout = FlatLayout.of(weights)
        >>> group = PackedGroup("g", layout, pack(weights, layout))
        >>> ring = Ring([group], torch.device("cpu"), slots=2)
        >>> slot, views = ring.enter(group, [])
        >>> views[0]
        tensor([0., 1., 2.])
        >>> ring.exit(slot)
    """

    def __init__(self, groups: list[PackedGroup], device: torch.device, slots: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        size = max((g.layout.nbytes for g in groups), default=0)
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(max(1, slots))]
        self.holding: list[PackedGroup | None] = [None] * len(self.buffers)
        self.ready: list[Any] = [None] * len(self.buffers)  # copy-done events
        self.released: list[Any] = [None] * len(self.buffers)  # last-use-done events
        self.in_use: set[int] = set()
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.prefetched = 0
        self.misses = 0

    def _load(self, group: PackedGroup, slot: int) -> None:
        buffer = self.buffers[slot]
        n = group.layout.nbytes
        if self.cuda:
            assert self.side is not None
            with torch.cuda.stream(self.side):
                if self.released[slot] is not None:
                    self.side.wait_event(self.released[slot])  # never overwrite a slot still being read
                buffer[:n].copy_(group.host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.side)
            self.ready[slot] = event
        else:
            buffer[:n].copy_(group.host)
        self.holding[slot] = group

    def _free_slot(self, keep: set[int]) -> int | None:
        for slot in range(len(self.buffers)):
            if slot not in self.in_use and slot not in keep and self.holding[slot] is None:
                return slot
        for slot in range(len(self.buffers)):
            if slot not in self.in_use and slot not in keep:
                return slot
        return None

    def enter(self, group: PackedGroup, upcoming: list[PackedGroup]) -> tuple[int, list[torch.Tensor]]:
        """Make ``group`` available on the device; prefetch ``upcoming``. Returns (slot, views)."""
        slot = next((s for s, g in enumerate(self.holding) if g is group and s not in self.in_use), None)
        if slot is None:
            self.misses += 1
            slot = self._free_slot(set())
            if slot is None:  # every slot busy (nested groups): a temporary buffer
                temporary = group.host.to(self.device, non_blocking=True)
                return -1, unpack(temporary, group.layout)
            self._load(group, slot)
        else:
            self.prefetched += 1
        if self.cuda and self.ready[slot] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
        self.in_use.add(slot)
        views = unpack(self.buffers[slot], group.layout)
        keep = {slot}
        for following in upcoming:
            if any(g is following for g in self.holding):
                continue
            target = self._free_slot(keep)
            if target is None:
                break
            self._load(following, target)
            keep.add(target)
        return slot, views

    def exit(self, slot: int) -> None:
        """The group in ``slot`` finished computing; the slot may be refilled after this point."""
        if slot < 0:
            return
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.released[slot] = event
        self.in_use.discard(slot)
