"""Streaming packed groups through a small ring of reusable device buffers.

Each streamed group's weights live in flat host buffers, one per dtype (pinned when the
device is an accelerator): the parameters themselves are views into them, so they are the
only host copy. Before a group runs, its buffers are copied (one transfer each, usually one
or two) into a free slot of a ring of device buffers and the modules get views of that slot
(cast to the compute dtype on the device when the storage dtype differs). While a group computes, the next groups along
the recorded execution order are copied into other slots on a side stream, each copy
ordered after the last use of its slot by events, so results are exactly those of the
resident model. Every device operation, timing included, goes through one
:class:`~torchsurgery._device.OffloadDevice`; on a CPU the same machinery runs with
plain synchronous copies, and the test suite runs it on its own asynchronous device
(``tests/tardy``, a registered backend whose copies land late).

Forwards that record gradients do not use the ring (autograd keeps the weights it saved
until backward, and a slot would be overwritten by then); they convert from the host
buffer directly.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchsurgery._device import OffloadDevice
from torchsurgery.compact import (
    OffloadedTensor,
    dequantize,
    own_scale,
    refuse_file_export,
    rehome,
    stored_values,
)
from torchsurgery.offloading.file_format import FileConversion
from torchsurgery.offloading.forward_lock import ForwardLock
from torchsurgery.offloading.order import OrderRecorder
from torchsurgery.offloading.packing import (
    FlatLayout,
    Slot,
    dtype_runs,
    pack_runs,
    run_bytes,
    unpack,
)
from torchsurgery.offloading.residency import GroupCost, stall_hint
from torchsurgery.offloading.stats import OffloadStats
from torchsurgery.patching import Patch


@dataclass(eq=False)
class PackedGroup:
    """A group's weights: in host buffers the parameters are views of, or read from a checkpoint file.

    Attributes:
        name: the group's root module.
        layout: the group's weights in one device slot, the slots of one dtype next to each other.
        tensors: a group held in memory: its parameters, in layout order. Their memory is the
            host copy (one buffer per dtype run); nothing else holds it, so copies and saves
            of the model carry it.
        source: a group left in a checkpoint file: the file (a ``torchsurgery._checkpoint`` source).
        keys: the file's keys, in layout order.
        pinned: whether the host buffers are page-locked (the ring re-packs them so).
        scales: a group read from a scaled fp8 checkpoint (ComfyUI's layout): each weight's
            scale (fp32, 0-dim; its values are ``q * scale``) or ``None``, in layout order.
        scaled: the scaled weights among ``tensors`` (:mod:`torchsurgery.compact.scaled`; their
            ``q`` in their slots; from a file: those quantised as they are read), each once:
            their scales take the layout's last slots, in this order.
        conversion: a group from a file kept in a narrower format than the file's: how its file
            bytes become its layout (:mod:`~torchsurgery.offloading.file_format`), or ``None``.
        narrow: a group from a file: the weights a CPU's matmul layer reads as they are kept
            (``ParamPlan.reads_narrow``), each once.
    """

    name: str
    layout: FlatLayout
    tensors: tuple[torch.Tensor, ...] = ()
    source: Any = None
    keys: tuple[str, ...] = ()
    pinned: bool = False
    scales: tuple[torch.Tensor | None, ...] = ()
    scaled: tuple[torch.Tensor, ...] = ()
    conversion: FileConversion | None = None
    narrow: tuple[torch.Tensor, ...] = ()

    @property
    def from_file(self) -> bool:
        """Whether the weights are read from the checkpoint file."""
        return self.source is not None

    @property
    def file_layout(self) -> FlatLayout:
        """The layout a read from the file fills: in the file's dtypes where the group converts them."""
        return self.conversion.layout if self.conversion is not None else self.layout

    def scaled_views(self, views: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each of the group's weights as brought in (``views``, in layout order) with its scale, if any."""
        return list(zip(views, self.scales or [None] * len(views), strict=True))

    def slot_values(self) -> list[torch.Tensor]:
        """What each slot of the layout holds, in the parameters' own memory: each weight's stored
        values, then each scaled weight's scale."""
        scales = [own_scale(t) for t in self.scaled]
        return [stored_values(t) for t in self.tensors] + [s for s in scales if s is not None]

    def split(self, views: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        """``views`` of the layout's slots as (each weight's values, each scaled weight's scale by ``id``)."""
        n = len(self.layout.slots) - len(self.scaled)
        return views[:n], dict(zip(map(id, self.scaled), views[n:], strict=True))

    def version(self) -> int:
        """Grows whenever one of the group's weights is written in place (optimizer steps, edits, loads).

        The sum of the parameters' version counters (an offloaded weight counts in the one of
        its stored values, which also sees writes through ``.data``).
        """
        # weights made under inference_mode (a .to(dtype) inside such a forward) count no versions
        return sum(v._version for v in self.slot_values() if not v.is_inference())

    def host_runs(self, allocate: Callable[[int], torch.Tensor] | None = None) -> list[tuple[int, torch.Tensor]]:
        """Per dtype run, its byte offset in the device slot and its host bytes (a ``uint8`` view).

        The bytes are the parameters' own memory. Where the parameters of a run no longer
        share one buffer at their layout offsets (a plain ``pickle`` gives each its own),
        the run is packed again first into a buffer from ``allocate(nbytes)`` (default: plain
        host memory), the parameters becoming views of it.
        """
        out = []
        slots = self.slot_values()
        for first, end in dtype_runs(self.layout):
            start, stop = run_bytes(self.layout, first, end)
            values = slots[first:end]
            if not _share_one_buffer(values, self.layout.slots[first:end], start):
                self._repack(first, end, allocate or functools.partial(torch.empty, dtype=torch.uint8))
                values = self.slot_values()[first:end]
            storage = values[0].untyped_storage()
            out.append((start, torch.empty(0, dtype=torch.uint8).set_(storage, 0, (stop - start,), (1,))))
        return out

    def _repack(self, first: int, end: int, allocate: Callable[[int], torch.Tensor]) -> None:
        start, stop = run_bytes(self.layout, first, end)
        run = FlatLayout(tuple(Slot(s.offset - start, s.shape, s.dtype) for s in self.layout.slots[first:end]), stop - start)
        n = len(self.tensors)
        for i, view in enumerate(pack_runs(self.slot_values()[first:end], run, allocate), start=first):
            t = self.tensors[i] if i < n else self.scaled[i - n]
            if i >= n:
                rehome(t, None, scale=view)  # type: ignore[arg-type]  # a scaled weight: an OffloadedTensor
            elif isinstance(t, OffloadedTensor):
                rehome(t, view)
            else:
                t.data = view

    def fill(self, out: torch.Tensor) -> None:
        """Write the group's bytes into ``out`` (a CPU uint8 buffer) from memory or the file."""
        if not self.from_file:
            for offset, data in self.host_runs():
                out[offset : offset + data.numel()].copy_(data)
            return
        # one bulk read: tensors next to each other in the file come in one system call (and are
        # converted, weight by weight, where the group keeps another format than the file's)
        raw = out if self.conversion is None else torch.empty(self.file_layout.nbytes, dtype=torch.uint8)
        self.source.read_many(list(zip(self.keys, unpack(raw, self.file_layout), strict=True)))
        if self.conversion is not None:
            self.conversion.convert(raw, out, self.layout)


def _share_one_buffer(values: list[torch.Tensor], slots: tuple[Slot, ...], start: int) -> bool:
    """Whether ``values`` are views of one buffer at their slots' offsets from ``start``."""
    storage = values[0].untyped_storage()
    return storage.nbytes() >= slots[-1].end - start and all(
        v.untyped_storage().data_ptr() == storage.data_ptr() and v.storage_offset() * v.element_size() == s.offset - start
        for v, s in zip(values, slots, strict=True)
    )


class Ring:
    """``slots`` device buffers, each big enough for the largest packed group.

    Every device operation goes through ``device`` (an
    :class:`~torchsurgery._device.OffloadDevice`). Each slot carries two events: its
    copy's end (``ready``; the compute stream waits on it before reading the slot) and its
    last use's end (``released``; the copy stream waits on it before overwriting the slot).

    Example:
        >>> import torch
        >>> from torchsurgery._device import resolve_device
        >>> from torch import nn
        >>> from torchsurgery.offloading.packing import FlatLayout
        >>> weights = (nn.Parameter(torch.arange(3.0)),)
        >>> group = PackedGroup("g", FlatLayout.of(weights), weights)
        >>> ring = Ring([group], resolve_device("cpu", "example"), slots=2)
        >>> slot, views, _ = ring.enter(group, [])
        >>> views[0]
        tensor([0., 1., 2.])
        >>> ring.exit(slot)
    """

    def __init__(self, groups: list[PackedGroup], device: OffloadDevice, slots: int) -> None:
        self.device = device
        size = max((g.layout.nbytes for g in groups), default=0)
        self.buffers = [device.empty(size) for _ in range(max(1, slots))]
        self.nbytes = size * len(self.buffers)  # held on the device for as long as the ring lives
        self.holding: list[PackedGroup | None] = [None] * len(self.buffers)
        self.copied: list[int] = [0] * len(self.buffers)  # the group's version when it was copied in
        self.ready: list[Any] = [None] * len(self.buffers)  # copy-done events
        self.released: list[Any] = [None] * len(self.buffers)  # last-use-done events
        self.copy_start: list[Any] = [None] * len(self.buffers)  # for timing the copies
        self.in_use: set[int] = set()
        self.side = device.new_stream()
        self.staging: torch.Tensor | None = None
        self.staged: Any = None  # the end of the last copy that read the staging buffer
        self.reader: Any = None  # a FileReader: reads file groups ahead (offloading.file_reader)
        self.lent: list[torch.Tensor | None] = [None] * len(self.buffers)  # on a CPU: a slot's bytes in the reader's buffer
        self.prefetched = 0
        self.misses = 0

    def _load(self, group: PackedGroup, slot: int) -> None:
        device = self.device
        buffer = self.buffers[slot]
        n = group.layout.nbytes
        self.copied[slot] = group.version()
        reader = self.reader if self.reader is not None and self.reader.serves(group) else None
        if device.host_compute:  # the slot is host memory: fill it in place, no copy
            self.copy_start[slot] = device.record(self.side)
            if reader is not None:
                self.lent[slot] = reader.take(group)  # computed on where it was read into
            else:
                group.fill(buffer)
            self.ready[slot] = device.record(self.side)
            self.holding[slot] = group
            return
        if reader is not None:  # read ahead into a reused (pinned) buffer
            sources = [(0, reader.take(group))]
        elif group.from_file:  # through one reused (pinned) staging buffer
            if self.staging is None:
                size = buffer.numel()
                self.staging = device.pinned_empty(size) if device.can_pin else torch.empty(size, dtype=torch.uint8)
            if self.staged is not None:
                device.synchronize(self.staged)  # the staging buffer's previous copy has read it
            group.fill(self.staging)
            sources = [(0, self.staging[:n])]
        else:
            # the parameters' own memory, one copy per dtype run
            sources = group.host_runs(device.pinned_empty if group.pinned else None)
        if self.released[slot] is not None:
            device.wait(self.side, self.released[slot])  # never overwrite a slot still being read
        self.copy_start[slot] = device.record(self.side)
        for offset, source in sources:
            device.copy_(buffer[offset : offset + source.numel()], source, self.side)
        self.ready[slot] = device.record(self.side)
        if reader is not None:
            reader.give_back(sources[0][1], self.ready[slot])
        elif group.from_file:
            self.staged = self.ready[slot]
        self.holding[slot] = group

    def _held(self, group: PackedGroup) -> int | None:
        """A slot holding ``group`` as its host weights are now; slots holding an older copy are freed."""
        found = None
        for slot, held in enumerate(self.holding):
            if held is not group or slot in self.in_use:
                continue
            if self.copied[slot] != group.version():
                self.holding[slot] = None  # the weights changed since: copy them in again
            elif found is None:
                found = slot
        return found

    def _free_slot(self, keep: set[int]) -> int | None:
        for slot in range(len(self.buffers)):
            if slot not in self.in_use and slot not in keep and self.holding[slot] is None:
                return slot
        for slot in range(len(self.buffers)):
            if slot not in self.in_use and slot not in keep:
                return slot
        return None

    def enter(
        self, group: PackedGroup, upcoming: list[PackedGroup]
    ) -> tuple[int, list[torch.Tensor], tuple[Any, Any] | None]:
        """Make ``group`` available on the device; prefetch ``upcoming``.

        Returns:
            (slot, views of the weights, the (start, end) events of the copy that brought
            them in, or ``None`` when there was none to time).
        """
        device = self.device
        slot = self._held(group)
        if slot is None:
            self.misses += 1
            # rather not evict a group copied ahead for the coming runs
            ahead = {s for s, g in enumerate(self.holding) if any(g is u for u in upcoming)}
            slot = self._free_slot(ahead)
            if slot is None:
                slot = self._free_slot(set())
            if slot is None:  # every slot busy (nested groups): a temporary buffer, in stream order
                temporary = torch.empty(group.layout.nbytes, dtype=torch.uint8)
                group.fill(temporary)
                if device.host_compute:
                    return -1, unpack(temporary, group.layout), None
                buffer = device.empty(group.layout.nbytes)
                device.copy_(buffer, temporary, device.current_stream())
                return -1, unpack(buffer, group.layout), None
            self._load(group, slot)
        else:
            self.prefetched += 1
        device.wait(device.current_stream(), self.ready[slot])
        self.in_use.add(slot)
        try:
            lent = self.lent[slot]
            views = unpack(self.buffers[slot] if lent is None else lent, group.layout)
            timing = (self.copy_start[slot], self.ready[slot])
            keep = {slot}
            for following in upcoming:
                if self.reader is not None and self.reader.serves(following) and (
                        device.host_compute or not self.reader.ready(following)):
                    continue  # its read is ahead already: copied once it landed, never waited for here
                held = next((s for s, g in enumerate(self.holding) if g is following and self.copied[s] == following.version()), None)
                if held is not None:
                    keep.add(held)  # copied ahead already: not to be evicted by the next ones
                    continue
                target = self._free_slot(keep)
                if target is None:
                    break
                self._load(following, target)
                keep.add(target)
        except BaseException:
            self.exit(slot)  # the caller never got the slot: it would stay in use for good
            raise
        return slot, views, timing

    def forget(self, group: PackedGroup) -> None:
        """``group`` no longer streams: a slot holding it counts as free."""
        self.holding = [None if g is group else g for g in self.holding]

    def exit(self, slot: int) -> None:
        """The group in ``slot`` finished computing; the slot may be refilled after this point."""
        if slot < 0:
            return
        self.released[slot] = self.device.record(self.device.current_stream())
        self.in_use.discard(slot)
        held, lent = self.holding[slot], self.lent[slot]
        if held is not None and self.reader is not None and self.reader.serves(held):
            self.holding[slot] = None  # read again (ahead) for its next run: the reader counts every read
        if lent is not None:  # on a CPU: the reader's buffer, back to it
            self.reader.give_back(lent)
            self.lent[slot] = None


@dataclass(eq=False)
class _Measure:
    """The events bracketing one run of a group, read once they completed."""

    name: str
    nbytes: int
    start: Any  # compute stream, before the group's weights were asked for
    ready: Any  # compute stream, once they are in
    copy: tuple[Any, Any] | None  # copy stream, around the copy that brought them in
    end: Any = None  # compute stream, once the group finished


@dataclass(frozen=True)
class _Timing:
    """The last measured run of one group."""

    nbytes: int
    transfer_s: float
    compute_s: float


class Streaming:
    """What a handle's streamed groups share: the device, bytes in flight, execution order, measured costs."""

    _SETTLE_EVERY = 1024  # pending measurements before they are read anyway (bounds their events)

    def __init__(self, device: OffloadDevice, stats: OffloadStats, prefetch: int = 1) -> None:
        _transfers_outside_compiled()
        self.device = device
        self.stats = stats
        self.current = 0
        self.prefetch = prefetch
        self.order = OrderRecorder()
        self.packed: dict[str, PackedGroup] = {}
        self.ring: Ring | None = None
        self.restart = False  # a copy: make the ring at the first forward
        self.pending: list[_Measure] = []
        self.timings: dict[str, _Timing] = {}
        self.lock = ForwardLock()  # one thread at a time runs the model (streamed groups swap weights in)
        self.reader: Any = None  # a FileReader for groups streamed from a checkpoint file

    def __getstate__(self) -> dict[str, Any]:
        # a copy (pickle, torch.save, deepcopy) makes its own ring at its first forward: the
        # ring's device buffers, streams and events belong to this process and this model
        state = {k: v for k, v in self.__dict__.items() if k not in ("lock", "ring", "pending", "reader")}
        # (a copy reads its file groups as they are needed, without read-ahead or a host tier)
        return {**state, "ring": None, "pending": [], "reader": None, "restart": self.ring is not None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        _transfers_outside_compiled()
        self.__dict__.update(state)
        self.lock = ForwardLock()

    def add(self, packed: PackedGroup) -> None:
        """Stream ``packed`` through the ring (before :meth:`start`)."""
        self.packed[packed.name] = packed

    def start(self) -> None:
        """Make the ring, once every packed group is known."""
        self.ring = Ring(list(self.packed.values()), self.device, slots=self.prefetch + 1)
        self.ring.reader = self.reader
        self.restart = False

    def drop_ring(self) -> None:
        """Free the ring once the copies into it have landed (its counts stay in the statistics);
        the next forward makes a new one, unless :meth:`start` does first."""
        if self.ring is not None:
            self.device.synchronize()
            self.stats.prefetch_hits += self.ring.prefetched
            self.stats.prefetch_misses += self.ring.misses
            self.ring = None
        self.restart = True

    def stop_streaming(self, name: str) -> PackedGroup | None:
        """Take group ``name`` out of the ring (it became resident); its packed weights."""
        packed = self.packed.pop(name, None)
        if packed is not None and self.ring is not None:
            self.ring.forget(packed)
        if packed is not None and self.reader is not None and self.reader.serves(packed):
            self.reader.forget(name)
        return packed

    def close(self) -> None:
        """Drop the ring and the packed groups, keeping the ring's counts in the statistics."""
        self.drop_ring()
        if self.reader is not None:
            self.reader.close()  # waits for the reads in flight
            self.reader = None
        self.restart = False
        self.packed.clear()
        self.pending = []

    def settle(self) -> None:
        """Read the timings of the groups that finished (waits for their events on the device)."""
        device, stats = self.device, self.stats
        still: list[_Measure] = []
        for m in self.pending:
            if m.end is None:
                still.append(m)  # running now
                continue
            waited = device.elapsed(m.start, m.ready)
            transfer = device.elapsed(*m.copy) if m.copy is not None else waited
            stats.seconds_waiting += waited
            stats.seconds_transferring += transfer
            self.timings[m.name] = _Timing(m.nbytes, transfer, device.elapsed(m.ready, m.end))
        self.pending = still

    def measured(self, names: list[str]) -> tuple[list[GroupCost], float]:
        """The settled costs of ``names`` (in order, repeats kept) and the link's bytes per second."""
        self.settle()
        known = [n for n in names if n in self.timings]
        once = [self.timings[n] for n in dict.fromkeys(known)]
        moved = sum(t.nbytes for t in once)
        seconds = sum(t.transfer_s for t in once)
        bandwidth = moved / seconds if seconds > 0 else float("inf")
        return [GroupCost(n, self.timings[n].nbytes, self.timings[n].compute_s) for n in known], bandwidth

    def snapshot(self, widened_bytes: int) -> OffloadStats:
        """The statistics so far, with the groups' measured costs (waits for the timing events of
        the groups that ran) and ``widened_bytes`` held now by the narrow weights' widening buffers."""
        hint = self.hint()
        s, ring = self.stats, self.ring
        order = self.order.recorded
        costs, bandwidth = self.measured(list(dict.fromkeys(order)))
        return OffloadStats(
            bytes_moved=s.bytes_moved,
            transfers=s.transfers,
            seconds_waiting=s.seconds_waiting,
            peak_device_bytes=s.peak_device_bytes,
            resident_bytes=s.resident_bytes,
            resident_groups=list(s.resident_groups),
            streamed_groups=list(s.streamed_groups),
            hint=hint,
            seconds_transferring=s.seconds_transferring,
            prefetch_hits=s.prefetch_hits + (ring.prefetched if ring is not None else 0),
            prefetch_misses=s.prefetch_misses + (ring.misses if ring is not None else 0),
            execution_order=order,
            group_costs=costs,
            link_bytes_per_s=bandwidth if costs else 0.0,
            widened_bytes=widened_bytes,
            storage_bytes_read=s.storage_bytes_read,
            peak_host_bytes=s.peak_host_bytes,
        )

    def hint(self) -> str:
        groups, bandwidth = self.measured(self.order.recorded)
        if not groups:
            return "no streamed group has run yet"
        if bandwidth == float("inf"):
            return "compute-bound: every transfer is hidden behind compute"
        named = [GroupCost(g.name or "<root>", g.nbytes, g.compute_s) for g in groups]
        return stall_hint(named, [], bandwidth=bandwidth)


class StartForward:
    """A forward pre-hook on the model: the forward runs alone (see :class:`~torchsurgery.offloading.forward_lock.ForwardLock`; picklable)."""

    def __init__(self, streaming: Streaming) -> None:
        self.streaming = streaming

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        lock = self.streaming.lock
        lock.begin_forward(module)
        if not any(isinstance(h, EndForward) and h.streaming.lock is lock for h in module._forward_hooks.values()):
            lock.release()  # the offload was removed while this thread waited: nothing would release it


class EndForward:
    """A forward hook on the model (also called when the forward raised): closes the recorded
    execution order and lets the next forward in (picklable)."""

    def __init__(self, streaming: Streaming) -> None:
        self.streaming = streaming

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return  # compiled forwards read the stored weights in the graph: nothing streams
        try:
            self.streaming.order.end_forward()
            if self.streaming.reader is not None:
                self.streaming.reader.end_forward()
        finally:
            self.streaming.lock.release()


class AfterFirst:
    """A forward hook on the model running ``after`` once, at the end of the first forward
    without gradients that completed (picklable); a forward that raised does not call it.

    It closes the recorded order first (``after`` reads it). If ``after`` raises, it runs
    again after the next such forward: it must leave the model as it found it when it fails
    (an out-of-memory error while making groups resident). Registered before
    :class:`EndForward`, so it runs while the forward still holds the lock.
    """

    def __init__(self, streaming: Streaming, after: Callable[[], None]) -> None:
        self.streaming = streaming
        self.after: Callable[[], None] | None = after

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        self.streaming.order.end_forward()
        if self.after is None or torch.is_grad_enabled():
            # not after a forward that recorded gradients: making a group resident swaps its
            # weights, which would poison the graph whose backward is still to run (and such
            # a forward copies without the ring, so its timings are not the ring's)
            return
        after, self.after = self.after, None
        try:
            after()
        except BaseException:
            self.after = after
            raise


def _through(narrow: torch.dtype | None) -> torch.dtype | None:
    """The dtype a weight's values are rounded to on their way in: its narrow copy's (a master's
    shadow dtype), in forwards without gradients only (those that record gradients read the master)."""
    return narrow if narrow is not None and not torch.is_grad_enabled() else None


_outside_lock = threading.Lock()
_transfers_outside = False


def _transfers_outside_compiled() -> None:
    """Have compiled code run every streamer's :meth:`GroupStreamer.bring_in` and
    :meth:`GroupStreamer.release` outside its graphs (``torch.compiler.disable``), once per process.

    The transfers stay out of compiled regions; the group's compute between them compiles.
    Applied when the first :class:`Streaming` is made or unpickled (no streamer runs before
    one is) rather than as decorators at import: ``torch.compiler.disable`` imports
    ``torch._dynamo``, which takes longer than torch itself, and a process that never streams
    a weight needs none of it.
    """
    global _transfers_outside
    with _outside_lock:
        if _transfers_outside:
            return
        GroupStreamer.bring_in = torch.compiler.disable(GroupStreamer.bring_in)  # type: ignore[method-assign]
        GroupStreamer.release = torch.compiler.disable(GroupStreamer.release)  # type: ignore[method-assign]
        _transfers_outside = True


class GroupStreamer:
    """Brings one group's weights in for its forward and puts the stored ones back after.

    ``narrow`` gives, for each entry of ``packed_entries + other_entries``, the dtype of its
    narrow copy where it keeps a master (``None`` elsewhere): forwards without gradients read
    the master rounded to it, as they read a resident weight's copy, so a weight computes the
    same whether it streams or stays resident.
    """

    def __init__(
        self,
        name: str,
        packed_entries: list[tuple[nn.Module, str, nn.Parameter, torch.dtype]],
        other_entries: list[tuple[nn.Module, str, nn.Parameter, torch.dtype]],
        packed: PackedGroup | None,
        streaming: Streaming,
        narrow: list[torch.dtype | None] | None = None,
    ) -> None:
        self.name = name
        self.packed_entries = packed_entries
        self.other_entries = other_entries
        self.narrow = narrow if narrow is not None else [None] * (len(packed_entries) + len(other_entries))
        self.packed = packed
        self.streaming = streaming
        # bytes brought in per run, as they are stored (what crosses the link, and what the plan
        # counts): the packed slots, and the weights converted directly
        self.nbytes = sum(s.nbytes for s in packed.layout.slots) if packed is not None else 0
        self.nbytes += sum(stored_values(p).nbytes for _, _, p, _ in other_entries)
        self.depth = 0
        self.detached = False  # the offload took its patch off (removed, or converted and installed again)
        self.slot: int | None = None
        self.measure: _Measure | None = None
        self.fresh = 0  # device bytes held for the group's current run besides the ring
        # made resident after a forward: the weights stay on the device and nothing comes in (the
        # patch stays until the offload is removed, so no class changes while threads wait)
        self.resident = False
        # weights read from a checkpoint file cannot come in inside a compiled graph
        self.traceable = packed is None or not packed.from_file
        self.scales: list[torch.Tensor | None] = []  # the packed weights' scales where they compute, once needed
        # on a CPU a packed scaled weight computes as it is kept (its products scale the sums), compiled too;
        # so does one read from a file that a matmul layer reads narrow
        scaled = {id(t) for t in packed.scaled + packed.narrow} if packed is not None else set()
        self.as_kept = [streaming.device.host_compute and id(p) in scaled for _, _, p, _ in packed_entries + other_entries]

    def _on_device(self, views: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each packed weight's view in the ring with its scale (a scaled checkpoint's) on the same device."""
        assert self.packed is not None
        if not self.scales:
            self.scales = [s if s is None else s.to(v.device) for v, s in self.packed.scaled_views(views)]
        return list(zip(views, self.scales, strict=True))

    def bring_in(self) -> bool:  # outside compiled regions (_transfers_outside_compiled); the group's compute compiles
        """Bring the weights in (once this thread holds the forward lock, until :meth:`release`);
        ``False`` (nothing held) where the offload was converted or removed while it waited."""
        self.streaming.lock.acquire()  # held until the matching release(), by this thread
        if self.detached:
            self.streaming.lock.release()
            return False
        self.depth += 1
        if self.depth > 1 or self.resident:
            return True  # re-entered (a shared module): already in; or resident
        streaming = self.streaming
        device = streaming.device
        start = device.record(device.current_stream())
        streaming.order.ran(self.name)
        copy = None
        try:
            entries = list(zip(self.packed_entries + self.other_entries, self.narrow, strict=True))
            direct = entries[len(self.packed_entries):]
            if self.packed is not None and self.packed.from_file and torch.is_grad_enabled():
                raise RuntimeError(
                    f"torchsurgery.offload: group {self.name!r} streams from a checkpoint file, which "
                    "serves inference only; run the model under torch.no_grad()"
                )
            if streaming.restart:
                streaming.start()
            fresh = 0  # device bytes this group allocates besides the ring's slots
            if self.packed is not None and streaming.ring is not None and not torch.is_grad_enabled():
                upcoming = [streaming.packed[n] for n in streaming.order.ahead(self.name, streaming.prefetch) if n in streaming.packed]
                self.slot, views, copy = streaming.ring.enter(self.packed, upcoming)
                if self.slot < 0:  # every slot busy: a temporary buffer
                    fresh += self.packed.layout.nbytes
                fresh += self._install(entries, views)
            else:
                direct = entries  # autograd keeps these until backward
            for (owner, pname, p, dtype), narrow in direct:
                through = _through(narrow)
                if stored_values(p).device != device.device:  # one copy per run, also of a weight reading as the device
                    value = torch.ops.aten._to_copy.default(p, device=device.device, dtype=through or dtype, non_blocking=True)
                else:
                    value = p.to(device=device.device, dtype=through or dtype, non_blocking=True)
                owner._parameters[pname] = value if value.dtype == dtype else value.to(dtype)
                fresh += p.numel() * dtype.itemsize
        except BaseException:
            self.depth = 1
            self.release()
            raise
        self.measure = _Measure(self.name, self.nbytes, start, device.record(device.current_stream()), copy)
        streaming.pending.append(self.measure)
        stats = streaming.stats
        stats.bytes_moved += self.nbytes
        stats.transfers += 1
        self.fresh = fresh
        streaming.current += fresh
        ring = streaming.ring.nbytes if streaming.ring is not None else 0
        stats.peak_device_bytes = max(stats.peak_device_bytes, stats.resident_bytes + ring + streaming.current)
        return True

    def _install(self, entries: list[tuple[tuple[nn.Module, str, nn.Parameter, torch.dtype], torch.dtype | None]],
                 views: list[torch.Tensor]) -> int:
        """The packed weights' views of their slot in their modules, as they compute; the device bytes
        their casts take.

        A scaled weight comes as its ``q`` and scale: on a CPU it reads as a weight kept whole
        does (its products scale the sums); on an accelerator it is widened on the device into
        the plain weight (:func:`~torchsurgery.compact.scaled.dequantize`, bit for bit), as a
        scaled checkpoint's weight is everywhere. On a CPU a weight read from a file into a narrower
        ``storage_dtype`` that its matmul layer reads narrow (``ParamPlan.reads_narrow``) reads as kept too.
        """
        assert self.packed is not None
        values, scales = self.packed.split(views)
        fresh = 0
        for ((owner, pname, p, dtype), narrow), (view, file_scale), kept in zip(
                entries, self._on_device(values), self.as_kept, strict=False):
            kept_scale, through = scales.get(id(p)), _through(narrow)  # (the packed ones)
            scale = kept_scale if kept_scale is not None else file_scale  # (a scaled checkpoint's: values q * scale)
            if kept:  # on a CPU: a scaled weight, or one a matmul layer reads narrow
                view = OffloadedTensor(view, dtype, scale=kept_scale)
            elif scale is not None:
                view = dequantize(view, scale, dtype)
                fresh += view.nbytes
            else:
                view = view if through is None else view.to(through)
                if view.dtype != dtype:
                    view = view.to(dtype)
                    fresh += view.nbytes
            owner._parameters[pname] = view  # type: ignore[assignment]
        return fresh

    def release(self) -> None:  # outside compiled regions, as bring_in
        try:
            self._put_back()
        finally:
            self.streaming.lock.release()

    def _put_back(self) -> None:
        self.depth -= 1
        if self.depth > 0 or self.resident:
            return
        for owner, pname, p, _ in self.packed_entries + self.other_entries:
            owner._parameters[pname] = p
        streaming = self.streaming
        if self.measure is not None:
            self.measure.end = streaming.device.record(streaming.device.current_stream())
            self.measure = None
            if len(streaming.pending) >= streaming._SETTLE_EVERY:
                streaming.settle()
        if self.slot is not None and streaming.ring is not None:
            streaming.ring.exit(self.slot)
            self.slot = None
        streaming.current = max(0, streaming.current - self.fresh)
        self.fresh = 0


class StreamedGroup(Patch, nn.Module):
    """The root module of a streamed group: its weights are in only while it runs.

    Attributes:
        offload_streamer: what brings the group's weights in (the offload's handle keeps
            its own reference to it; this one serves the patched ``forward``).
    """

    offload_streamer: GroupStreamer

    def __patch_init__(self, streamer: GroupStreamer) -> None:
        self.offload_streamer = streamer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        streamer = self.offload_streamer
        if streamer.resident:
            return super().forward(*args, **kwargs)
        if not streamer.traceable:
            refuse_file_export(streamer.name)
        if torch.compiler.is_compiling() and streamer.traceable:
            # compiled: bringing the weights in is part of the graph (a copy and a cast per
            # weight, no ring, no prefetch, no per-call Python state), so fullgraph holds; on a
            # CPU the copy is nothing and the cast reads the stored values in the graph. Always
            # a copy (even where .to() would keep a weight that reads as the compute dtype), so
            # the group computes with plain weights, as its eager forward does
            entries = streamer.packed_entries + streamer.other_entries
            device = streamer.streaming.device.device
            # the weights the module holds now: torch.export traces with fakes of its own in their place
            current = [owner._parameters[pname] for owner, pname, _, _ in entries]
            for (owner, pname, _, dtype), p, narrow, as_kept in zip(entries, current, streamer.narrow, streamer.as_kept, strict=True):
                if as_kept:
                    continue
                through = _through(narrow)
                value = torch.ops.aten._to_copy.default(p, device=device, dtype=through or dtype)
                owner._parameters[pname] = value if through is None else torch.ops.aten._to_copy.default(value, dtype=dtype)
            try:
                return super().forward(*args, **kwargs)
            finally:
                for (owner, pname, _, _), p in zip(entries, current, strict=True):
                    owner._parameters[pname] = p
        if not streamer.bring_in():
            return self.forward(*args, **kwargs)  # patched again, or not: as the module is now
        try:
            return super().forward(*args, **kwargs)
        finally:  # also on KeyboardInterrupt, which skips torch's always_call hooks
            streamer.release()
