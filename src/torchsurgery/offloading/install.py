"""Installing an offload plan on a model: every tensor to its storage, the streamed groups packed.

Storage and residency conversions swap data into the existing parameter objects
(``torch.utils.swap_tensors``), so optimizers and user references stay valid; every one
is checked before the first is made. A streamed group's weights are packed into flat host
buffers that the parameters are views into (or left in the checkpoint file, the
parameters ``meta``), and its root module is patched to bring them in. A weight kept in
another dtype or place than it computes in becomes an
:class:`~torchsurgery.compact.tensor.OffloadedTensor` (the same object). Each change is
recorded in the offload's :class:`~torchsurgery.offloading.originals.Originals` first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from torchsurgery._device import OffloadDevice
from torchsurgery._swap import swap_blocker, swap_in, wrap_like
from torchsurgery.compact import (
    OffloadedTensor,
    ReadContext,
    offloaded_like,
    own_scale,
    reads_elsewhere_only,
    rehome,
    stored_values,
)
from torchsurgery.offloading.attach import Attachments
from torchsurgery.offloading.checkpoint_values import CheckpointValues
from torchsurgery.offloading.file_format import file_layout
from torchsurgery.offloading.originals import Originals
from torchsurgery.offloading.packing import FlatLayout, pack_runs
from torchsurgery.offloading.plan import (
    GroupPlan,
    OffloadPlan,
    ParamPlan,
    Residency,
)
from torchsurgery.offloading.streams import GroupStreamer, PackedGroup, Streaming

__all__ = ["Installer", "moved", "as_computed", "Entry"]

_WHAT = "torchsurgery.offload"
_STORAGE_DEVICE = torch.device("cpu")

Entry = tuple[nn.Module, str, nn.Parameter, torch.dtype]
"""A streamed weight: (its owner, its attribute, the parameter, its compute dtype)."""


def moved(
    tensor: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
    pin: OffloadDevice | None = None,
    data: torch.Tensor | None = None,
) -> torch.Tensor:
    """What to swap into ``tensor`` to give it its values (or ``data``'s) on ``device`` in ``dtype``.

    Example:
        >>> import torch
        >>> moved(torch.ones(2), torch.device("cpu"), torch.float16).dtype
        torch.float16
    """
    data = (tensor if data is None else data).detach().to(device=device, dtype=dtype, copy=True)
    if pin is not None and data.device.type == "cpu":
        data = pin.pin(data)
    return wrap_like(tensor, data)


def as_computed(
    tensor: torch.Tensor, p: ParamPlan, stored: torch.Tensor, device: torch.device, reads: ReadContext,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """What to swap into ``tensor`` to give it the values ``stored`` (in ``p``'s storage dtype; a scaled
    weight's ``q`` with its ``scale``), read as it computes (on ``device``, the device it computes on,
    where the values stay on the host).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> from torchsurgery.compact import ReadContext, Scratch
        >>> from torchsurgery.offloading.stats import OffloadStats
        >>> layer = nn.Sequential(nn.Linear(2, 2))
        >>> p = torchsurgery.plan_offload(layer, storage_dtype=torch.float16, dtype=torch.float32).params[0]
        >>> w = layer[0].weight
        >>> view = as_computed(w, p, w.detach().half(), torch.device("cpu"), ReadContext(OffloadStats(), Scratch()))
        >>> view.dtype, view.stored.dtype
        (torch.float32, torch.float16)
    """
    where = device if p.reads_elsewhere(device) else None
    if p.scaled is not None and scale is None:  # ``stored`` holds the values to quantise (compact/scaled.py)
        stored, scale = p.scaled.quantize(stored)
    return offloaded_like(tensor, stored, p.compute_dtype, reads=reads, shadow_dtype=p.shadow_dtype, device=where, scale=scale)


def _made_meta(tensor: torch.Tensor, p: ParamPlan) -> bool:
    """Whether a weight the checkpoint file holds is swapped for a meta one: no values, read as it computes."""
    return not tensor.is_meta or tensor.dtype != p.compute_dtype


def _packed_scaled(p: ParamPlan) -> bool:
    """Whether ``p`` is a scaled weight packed into its group's host buffers (wrapped as it is packed)."""
    return p.scaled is not None and p.residency is Residency.STREAMED


@dataclass(eq=False)
class Installer:
    """Installs ``plan`` on the model whose modules are ``named``, recording every change in ``originals``.

    Attributes:
        plan: the plan.
        named: the model's modules by qualified name.
        originals: where each changed tensor was.
        streaming: what the streamed groups share (their packed weights are added to it).
        attached: where the streamed groups' patches and the ``state_dict`` hooks go.
        reads: the context narrow weights are read in.
        file: the checkpoint the plan streams from, if any.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> handle = torchsurgery.offload(nn.Sequential(nn.Linear(2, 2)), storage_dtype=torch.float16, dtype=torch.float32)
        >>> handle.model[0].weight.stored.dtype  # installed by an Installer
        torch.float16
        >>> _ = handle.remove()
    """

    plan: OffloadPlan
    named: dict[str, nn.Module]
    originals: Originals
    streaming: Streaming
    attached: Attachments
    reads: ReadContext
    file: CheckpointValues | None

    def install(self) -> None:
        """Every tensor to its storage, the streamed groups packed and patched, the ring made,
        the weights kept in another dtype or place read as they compute."""
        self._convert()
        for group in self.plan.groups:
            if not group.resident:
                self._stream(group)
        self.streaming.start()
        self._read_as_computed()
        stats, groups = self.streaming.stats, self.plan.groups
        stats.resident_groups = [g.name for g in groups if g.resident]
        stats.streamed_groups = [g.name for g in groups if not g.resident]
        stats.resident_bytes = sum(g.nbytes for g in groups if g.resident)
        stats.peak_device_bytes = stats.resident_bytes

    def _conversions(self) -> list[tuple[ParamPlan, torch.Tensor, torch.device, torch.dtype, bool]]:
        """What moves where before streaming starts: (plan entry, tensor, device, dtype, pin).

        Every weight goes to its storage dtype, resident on the device or in host memory: its
        values are the same whatever the budget made of it.
        """
        target, pin = self.plan.device, self.plan.pin_memory
        moves: list[tuple[ParamPlan, torch.Tensor, torch.device, torch.dtype, bool]] = []
        for group in self.plan.groups:
            for p in group.params:
                if p.tied_to is not None or p.residency is Residency.FILE:
                    continue  # converted under its first name; or the file has its values
                tensor = p.lookup_in(self.named)
                # a scaled weight moves in its own dtype: it is quantised when it is wrapped (or
                # packed, into host buffers pinned then)
                dtype = tensor.dtype if p.scaled is not None else p.storage_dtype
                if p.residency is Residency.RESIDENT:
                    moves.append((p, tensor, target, dtype, False))
                else:
                    moves.append((p, tensor, _STORAGE_DEVICE, dtype, pin and p.scaled is None))
        return moves

    def _convert(self) -> None:
        """Storage and residency conversions, every one checked before the first is made."""
        self._take_stored_values()
        target, seam = self.plan.device, self.plan.offload_device
        moves = [(p.name, t, to, dtype, pin) for p, t, to, dtype, pin in self._conversions() if not t.is_meta]
        seen: set[int] = set()
        for module in self.named.values():
            for bname, b in module._buffers.items():
                if b is not None and b.device != target and id(b) not in seen:
                    seen.add(id(b))
                    moves.append((bname, b, target, b.dtype, False))
        swapped = [(name, t) for name, t, to, dtype, _ in moves if t.device != to or t.dtype != dtype]
        swapped += [(p.name, p.lookup_in(self.named)) for p in self.plan.params if self._wrapped(p)]
        if self.file is not None:
            files = [(p, p.lookup_in(self.named)) for p in self.plan.params if p.residency is Residency.FILE]
            swapped += [(p.name, t) for p, t in files if _made_meta(t, p)]
        for name, tensor in swapped:
            problem = swap_blocker(name, tensor, None, _WHAT, weak_references_ok=True)
            if problem:
                raise RuntimeError(problem)
        for p, tensor, to, dtype, _ in self._conversions():
            if tensor.is_meta and p.file_key is not None:  # resident, its values only in the file
                assert self.file is not None
                self.originals.remember(p.name, tensor)
                swap_in(tensor, moved(tensor, to, dtype, data=self.file.read(p.file_key)))
        for name, tensor, to, dtype, pin in moves:
            if tensor.device != to or tensor.dtype != dtype or (pin and not seam.is_pinned(tensor)):
                self.originals.remember(name, tensor)
                swap_in(tensor, moved(tensor, to, dtype, pin=seam if pin else None))

    def _take_stored_values(self) -> None:
        """Weights that only read as another device (an installer's) hold their stored values, plain, from here on.

        The plan took them as those values; ``remove()`` makes them read as they did again.
        """
        lowered = [(p.name, t) for p in self.plan.params if reads_elsewhere_only(t := p.lookup_in(self.named))]
        for name, tensor in lowered:
            problem = swap_blocker(name, tensor, None, _WHAT, weak_references_ok=True)
            if problem:
                raise RuntimeError(problem)
        for name, tensor in lowered:
            self.originals.remember(name, tensor)
            swap_in(tensor, wrap_like(tensor, stored_values(tensor)))

    def _stream(self, group: GroupPlan) -> None:
        """Patch the group's root module to bring its streamed weights in (and its narrow layers)."""
        packable: list[tuple[Entry, ParamPlan]] = []
        others: list[tuple[Entry, ParamPlan]] = []
        for p in group.params:
            entry = (self.named[p.module], p.attr, p.lookup_in(self.named), p.compute_dtype)
            if p.residency in (Residency.STREAMED, Residency.FILE):
                packable.append((entry, p))
            elif p.residency is Residency.CONVERTED:
                others.append((entry, p))
        if not packable and not others:
            return
        # the slots of one storage dtype next to each other: one host buffer per dtype
        packable.sort(key=lambda ep: str(ep[1].storage_dtype))
        packed = self._pack(group, packable) if packable else None
        entries = [entry for entry, _ in packable]
        narrow = [p.shadow_dtype for _, p in packable + others]  # what forwards without gradients read
        streamer = GroupStreamer(group.name, entries, [entry for entry, _ in others], packed, self.streaming, narrow)
        self.attached.stream(group.name, self.named[group.name], streamer)

    def _wrapped(self, p: ParamPlan) -> bool:
        """Whether ``p`` becomes an OffloadedTensor: kept in another dtype, or away from the device it computes on."""
        return p.reads_as_computed() or p.reads_elsewhere(self.plan.device)

    def _read_as_computed(self) -> None:
        """Weights kept in another dtype or place than they compute in become OffloadedTensors (same objects).

        They then read as the compute dtype and device everywhere (``weight.dtype``,
        ``model.dtype``, ``model.device``, code inside and outside forwards), and
        ``state_dict()`` shows their stored values.
        """
        owners: dict[int, nn.Module] = {}
        for p in filter(self._wrapped, self.plan.params):
            tensor = p.lookup_in(self.named)
            if not _packed_scaled(p):  # those were wrapped as they were packed
                self.originals.remember(p.name, tensor)
                swap_in(tensor, as_computed(tensor, p, tensor.detach(), self.plan.device, self.reads))
            owner = self.named[p.module]
            owners[id(owner)] = owner
        for owner in owners.values():
            self.attached.show_stored_state(owner)

    def _pack(self, group: GroupPlan, packable: list[tuple[Entry, ParamPlan]]) -> PackedGroup:
        """The group's streamed weights in host buffers (their only host copy), or left in the file."""
        params = [param for (_, _, param, _), _ in packable]
        planned = [p for _, p in packable]
        if self.file is not None:
            # the weights stay in the file: the parameters become meta (same objects); the
            # file was proven to hold their values (remove() reads them back from it)
            keys = tuple(str(p.file_key) for p in planned)
            # in the storage format: converted from the file's as they are read where that is narrower
            layout, conversion, scaled = file_layout(self.file.source, keys, planned, params)
            for param, p in zip(params, planned, strict=True):
                self.originals.remember(p.name, param, p.file_key)
                if _made_meta(param, p):
                    meta = torch.empty_like(param, device="meta", dtype=p.compute_dtype)
                    swap_in(param, wrap_like(param, meta))
            scales = tuple(None if p.file_scale is None else self.file.scale(p.file_scale) for p in planned)
            narrow = tuple({id(t): t for t, p in zip(params, planned, strict=True) if p.reads_narrow}.values())
            packed = PackedGroup(group.name, layout, source=self.file.source, keys=keys, scales=scales, scaled=scaled,
                                 conversion=conversion, narrow=narrow)
        else:
            packed = self._pack_in_memory(group.name, params, planned)
        self.streaming.add(packed)
        return packed

    def _pack_in_memory(self, name: str, params: list[nn.Parameter], planned: list[ParamPlan]) -> PackedGroup:
        """The group's weights in host buffers, one per dtype run, the parameters views of them.

        A scaled weight is quantised and wrapped to read as it computes first; its ``q`` takes
        its slot, its scale one after every weight's values (the ring carries both).
        """
        for param, p in zip(params, planned, strict=True):
            self.originals.remember(p.name, param)
            if p.scaled is not None and not isinstance(param, OffloadedTensor):  # once, if tied within the group
                swap_in(param, as_computed(param, p, param.detach(), self.plan.device, self.reads))
        scaled = [t for t in {id(t): t for t in params}.values() if isinstance(t, OffloadedTensor) and own_scale(t) is not None]
        values = [stored_values(t) for t in params]
        scales = [s for s in map(own_scale, scaled) if s is not None]
        layout = FlatLayout.of(values + scales)
        pinned = self.plan.pin_memory
        allocate = self.plan.offload_device.pinned_empty if pinned else functools.partial(torch.empty, dtype=torch.uint8)
        views = pack_runs(values + scales, layout, allocate)
        for param, view in zip(params, views, strict=False):  # the scales' views follow
            if isinstance(param, OffloadedTensor):
                rehome(param, view)
            else:
                param.data = view
        for param, view in zip(scaled, views[len(values):], strict=True):
            rehome(param, None, scale=view)
        return PackedGroup(name, layout, tensors=tuple(params), pinned=pinned, scaled=tuple(scaled))
