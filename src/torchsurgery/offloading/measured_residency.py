"""After the first forward: streamed groups made resident by their measured costs.

The first forward without gradients measures each group that streams through the ring;
:func:`~torchsurgery.offloading.residency.plan_residency` then chooses those whose
transfers stall most, within what the budget leaves, and their weights move to the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torchsurgery._swap import swap_in
from torchsurgery.compact import ReadContext, dequantize, own_scale, stored_values
from torchsurgery.offloading.install import as_computed, moved
from torchsurgery.offloading.originals import Originals
from torchsurgery.offloading.packing import unpack
from torchsurgery.offloading.plan import OffloadPlan
from torchsurgery.offloading.residency import plan_residency
from torchsurgery.offloading.streams import GroupStreamer, Streaming

__all__ = ["MeasuredResidency"]


@dataclass(eq=False)
class MeasuredResidency:
    """Keeps resident, after the first forward, the ring groups whose transfers stall most.

    Attributes:
        plan: the installed plan (its ``measured_budget`` is what is left for these groups).
        named: the model's modules by qualified name.
        streaming: what the streamed groups share (order, measurements, ring).
        streamers: each streamed group's streamer, by name.
        originals: where each changed tensor was (a group made resident is recorded there).
        reads: the context narrow weights are read in.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        >>> handle = torchsurgery.offload(model, "cpu", storage_dtype=torch.float16, dtype=torch.float32, groups="leaves", budget=1 << 30)
        >>> handle.plan.measured_budget is None  # it fits: kept whole, nothing to measure
        True
        >>> _ = handle.remove()
    """

    plan: OffloadPlan
    named: dict[str, nn.Module]
    streaming: Streaming
    streamers: dict[str, GroupStreamer]
    originals: Originals
    reads: ReadContext

    def __call__(self) -> None:
        """Choose and make resident (run by the first forward's hook).

        Counted as :meth:`~torchsurgery.offloading.plan.OffloadPlan.device_bytes` counts the
        budget: the groups resident, next to a ring sized for the groups that still stream.
        The ring is freed first, every chosen group's values are put on the device, then
        swapped in, and the ring is made again for the groups left: an allocation that fails
        (out of memory), the values' or the new ring's, leaves every group streaming (the
        groups already swapped in are swapped back) and the ring is made again by the next
        forward (after which this runs again).
        """
        streaming, plan = self.streaming, self.plan
        budget = plan.budget
        if plan.measured_budget is None or budget is None:
            return
        resident = set(streaming.stats.resident_groups)
        names = [n for n in dict.fromkeys(streaming.order.recorded) if n in streaming.packed and self._may_stay(n, resident)]
        costs, bandwidth = streaming.measured(names)  # timings read through the device seam
        if not costs:
            return
        chosen = plan_residency(
            costs, budget, bandwidth, streaming.prefetch, fits=lambda keep: plan.device_bytes(resident.union(keep)) <= budget
        )
        if not chosen:
            return
        streaming.drop_ring()
        values = [(name, self._resident_values(name)) for name in chosen]
        stats = streaming.stats
        packed, resident_groups, streamed_groups = dict(streaming.packed), list(stats.resident_groups), list(stats.streamed_groups)
        resident_bytes = stats.resident_bytes
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for name, swaps in values:
                self._make_resident(name, swaps, swapped)
            streaming.start()
        except BaseException:  # the new ring did not fit next to the groups made resident: all stream again
            for tensor, replacement in reversed(swapped):
                swap_in(tensor, replacement)
            for name, _ in values:
                self.streamers[name].resident = False
            streaming.packed.clear()
            streaming.packed.update(packed)
            stats.resident_groups[:], stats.streamed_groups[:], stats.resident_bytes = resident_groups, streamed_groups, resident_bytes
            streaming.drop_ring()
            raise

    def _may_stay(self, name: str, resident: set[str]) -> bool:
        """Whether group ``name`` can be made resident: each weight it shares with another group
        is resident there already (moving a shared weight to the device would take it out of
        the host buffer the group that streams it packs it in)."""
        first = {p.name: g.name for g in self.plan.groups for p in g.params if p.tied_to is None}
        group = next(g for g in self.plan.groups if g.name == name)
        return all(first[p.tied_to] in resident for p in group.params if p.tied_to is not None and first[p.tied_to] != name)

    def _resident_values(self, name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each weight of streamed group ``name`` with what makes it resident (allocated on the
        device; nothing changes yet): in its storage dtype, read as it computes, as a group
        resident from the start holds it; else in the compute dtype."""
        streamer, device = self.streamers[name], self.plan.device
        packed = self.streaming.packed.get(name)
        values: dict[int, torch.Tensor] = {}
        if packed is not None and packed.from_file:
            # the group streams from the checkpoint file (its parameters are meta): read it once
            buffer = torch.empty(packed.layout.nbytes, dtype=torch.uint8)
            packed.fill(buffer)
            # a weight's scale: the file's (ComfyUI's layout) or its own (quantised as it was read)
            views, kept_scales = packed.split(unpack(buffer, packed.layout))
            for (_, _, p, _), (v, s) in zip(streamer.packed_entries, packed.scaled_views(views), strict=True):
                s = kept_scales.get(id(p), s)
                values[id(p)] = v if s is None else dequantize(v, s, torch.float32)
        planned = {id(p.lookup_in(self.named)): p for p in self.plan.params if p.tied_to is None}
        swaps: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _, _, p, dtype in streamer.packed_entries + streamer.other_entries:
            q = planned[id(p)]
            self.originals.remember(q.name, p)  # remove() gives it back (one that needed no move to start streaming too)
            if q.reads_as_computed():
                scale = own_scale(p)  # a scaled weight's moves with it
                kept = stored_values(p).detach().to(device, q.storage_dtype, copy=True)
                on_device = None if scale is None else scale.to(device, copy=True)
                swaps.append((p, as_computed(p, q, kept, device, self.reads, on_device)))
            else:
                swaps.append((p, moved(p, device, dtype, data=values.get(id(p)))))
        return swaps

    def _make_resident(
        self, name: str, swaps: list[tuple[torch.Tensor, torch.Tensor]], swapped: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Group ``name`` keeps its weights on the device from now on (``swaps``: see
        :meth:`_resident_values`; each pair swapped is appended to ``swapped``)."""
        self.streamers[name].resident = True
        self.streaming.stop_streaming(name)
        for tensor, replacement in swaps:
            swap_in(tensor, replacement)
            swapped.append((tensor, replacement))
        stats = self.streaming.stats
        stats.resident_groups.append(name)
        stats.streamed_groups.remove(name)
        stats.resident_bytes += next(g.nbytes for g in self.plan.groups if g.name == name)
