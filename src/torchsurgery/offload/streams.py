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

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchsurgery.offload.order import OrderRecorder
from torchsurgery.offload.packing import FlatLayout, unpack
from torchsurgery.offload.planner import GroupCost, stall_hint
from torchsurgery.offload.stats import OffloadStats
from torchsurgery.patching import Patch


@dataclass(eq=False)
class PackedGroup:
    """A group's weights in one flat host buffer, or read from a checkpoint file on demand."""

    name: str
    layout: FlatLayout
    host: torch.Tensor | None
    source: Any = None  # a torchsurgery._checkpoint source when the weights stay in a file
    keys: tuple[str, ...] = ()

    def fill(self, out: torch.Tensor) -> None:
        """Write the group's bytes into ``out`` (a CPU uint8 buffer) from memory or the file."""
        if self.host is not None:
            out[: self.layout.nbytes].copy_(self.host)
            return
        # one bulk read: tensors next to each other in the file come in one system call
        self.source.read_many(list(zip(self.keys, unpack(out, self.layout), strict=True)))


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
        self.staging: torch.Tensor | None = None
        self.prefetched = 0
        self.misses = 0

    def _load(self, group: PackedGroup, slot: int) -> None:
        buffer = self.buffers[slot]
        n = group.layout.nbytes
        if self.cuda:
            assert self.side is not None
            source = group.host
            if source is None:  # from the file, through one reused pinned staging buffer
                if self.staging is None or self.staging.numel() < n:
                    self.staging = torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=True)
                self.side.synchronize()  # the staging buffer's previous copy has finished
                group.fill(self.staging)
                source = self.staging[:n]
            with torch.cuda.stream(self.side):
                if self.released[slot] is not None:
                    self.side.wait_event(self.released[slot])  # never overwrite a slot still being read
                buffer[:n].copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.side)
            self.ready[slot] = event
        else:
            group.fill(buffer)
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
                temporary = torch.empty(group.layout.nbytes, dtype=torch.uint8)
                group.fill(temporary)
                return -1, unpack(temporary.to(self.device), group.layout)
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


class _Shared:
    """What a handle's streamed groups share: bytes in flight, execution order, measured costs."""

    def __init__(self, prefetch: int = 1) -> None:
        self.current = 0
        self.prefetch = prefetch
        self.order = OrderRecorder()
        self.packed: dict[str, PackedGroup] = {}
        self.ring: Ring | None = None
        self.costs: dict[str, list[float]] = {}  # name -> [bytes, transfer seconds, compute seconds]

    def hint(self) -> str:
        names = [n for n in dict.fromkeys(self.order.recorded) if n in self.costs]
        if not names:
            return "no streamed group has run yet"
        moved = sum(self.costs[n][0] for n in names)
        seconds = sum(self.costs[n][1] for n in names)
        if seconds <= 0:
            return "compute-bound: every transfer is hidden behind compute"
        groups = [GroupCost(n or "<root>", int(self.costs[n][0]), self.costs[n][2]) for n in self.order.recorded if n in self.costs]
        return stall_hint(groups, [], bandwidth=moved / seconds)


class _EndForward:
    """A forward hook on the model closing the recorded execution order (picklable)."""

    def __init__(self, order: OrderRecorder, after_first: Callable[[], None] | None = None) -> None:
        self.order = order
        self.after_first = after_first

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.order.end_forward()
        if self.after_first is not None:
            after, self.after_first = self.after_first, None
            after()  # e.g. plan residency from the first forward's measurements


class _GroupStreamer:
    """Brings one group's weights in for its forward and puts the stored ones back after."""

    def __init__(
        self,
        name: str,
        packed_entries: list[tuple[nn.Module, str, nn.Parameter, torch.dtype]],
        other_entries: list[tuple[nn.Module, str, nn.Parameter, torch.dtype]],
        packed: PackedGroup | None,
        target: torch.device,
        stats: OffloadStats,
        transit: _Shared,
    ) -> None:
        self.name = name
        self.packed_entries = packed_entries
        self.other_entries = other_entries
        self.packed = packed
        self.target = target
        self.stats = stats
        self.transit = transit
        self.nbytes = sum(p.numel() * dtype.itemsize for _, _, p, dtype in packed_entries + other_entries)
        self.depth = 0
        self.ready_at = 0.0
        self.slot: int | None = None

    @torch.compiler.disable  # transfers stay outside compiled regions; the group's compute compiles
    def bring_in(self) -> None:
        self.depth += 1
        if self.depth > 1:
            return  # re-entered (a shared module): already in
        start = time.perf_counter()
        shared = self.transit
        shared.order.ran(self.name)
        try:
            direct = self.other_entries
            if self.packed is not None and self.packed.host is None and torch.is_grad_enabled():
                raise RuntimeError(
                    f"torchsurgery.offload: group {self.name!r} streams from a checkpoint file, which "
                    "serves inference only; run the model under torch.no_grad()"
                )
            if self.packed is not None and shared.ring is not None and not torch.is_grad_enabled():
                upcoming = [shared.packed[n] for n in shared.order.ahead(self.name, shared.prefetch) if n in shared.packed]
                self.slot, views = shared.ring.enter(self.packed, upcoming)
                for (owner, pname, _, dtype), view in zip(self.packed_entries, views, strict=True):
                    owner._parameters[pname] = view if view.dtype == dtype else view.to(dtype)  # type: ignore[assignment]
            else:
                direct = self.packed_entries + self.other_entries  # autograd keeps these until backward
            for owner, pname, p, dtype in direct:
                owner._parameters[pname] = p.to(device=self.target, dtype=dtype, non_blocking=True)  # type: ignore[assignment]
        except BaseException:
            self.depth = 1
            self.release()
            raise
        stats = self.stats
        self.ready_at = time.perf_counter()
        waited = self.ready_at - start
        stats.seconds_waiting += waited
        shared.costs[self.name] = [self.nbytes, waited, shared.costs.get(self.name, [0, 0, 0.0])[2]]
        stats.bytes_moved += self.nbytes
        stats.transfers += 1
        shared.current += self.nbytes
        stats.peak_device_bytes = max(stats.peak_device_bytes, stats.resident_bytes + shared.current)

    @torch.compiler.disable
    def release(self) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        for owner, pname, p, _ in self.packed_entries + self.other_entries:
            owner._parameters[pname] = p
        shared = self.transit
        if self.slot is not None and shared.ring is not None:
            shared.ring.exit(self.slot)
            self.slot = None
        shared.current = max(0, shared.current - self.nbytes)
        cost = shared.costs.get(self.name)
        if cost is not None and self.ready_at:
            cost[2] = time.perf_counter() - self.ready_at  # this group's compute, last forward


class _StreamedGroup(Patch, nn.Module):
    """The root module of a streamed group: its weights are in only while it runs."""

    def __patch_init__(self, streamer: _GroupStreamer) -> None:
        self.__dict__["_offload_streamer"] = streamer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        streamer: _GroupStreamer = self.__dict__["_offload_streamer"]
        streamer.bring_in()
        try:
            return super().forward(*args, **kwargs)
        finally:  # also on KeyboardInterrupt, which skips torch's always_call hooks
            streamer.release()
