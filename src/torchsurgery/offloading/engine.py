"""The ``offload`` engine: weights live in storage and come in group by group.

Weights are kept in *storage* (host memory, optionally in a compact ``storage_dtype``, or
a checkpoint file) and brought to ``device``/``dtype`` just before their group runs, then
released. Within a ``budget``, groups whose transfers cannot be hidden behind compute
stay resident instead, held in the storage dtype too. With a storage dtype narrower than
the compute dtype it is "layerwise casting" and halves the weights' memory.

Mechanics, chosen so that nothing about the model's identity changes:

* storage and residency conversions swap data into the existing parameter objects
  (``torch.utils.swap_tensors``), so optimizers and user references stay valid;
* a streamed group's weights are packed into one flat host buffer that the parameters
  are views into, and its root module gets a patch whose forward brings the group in
  through a ring of device buffers (:mod:`torchsurgery.offloading.streams`) and puts the
  stored parameters back in a ``finally``, also on ``KeyboardInterrupt``;
* a weight stored in another dtype than it computes in becomes an
  :class:`~torchsurgery.compact.tensor.OffloadedTensor` (the same object): it reads as
  the compute dtype to every program, and on a CPU ``nn.Linear`` (and transformers
  ``Conv1D``) products read its narrow values directly, whatever the layer's ``forward``
  (patched or not) is.

:func:`offload` asks :func:`~torchsurgery.offloading.plan.plan_offload` for a plan (groups,
residency, dtypes, checkpoint keys; nothing changes yet), then the :class:`OffloadHandle`
installs it. Everything is recorded in the model's undo log; :meth:`OffloadHandle.remove`
(or ``torchsurgery.restore``) puts every tensor back on its device in its dtype, with its
identity (values are those of the storage dtype when that was narrower, resident or
streamed alike; with a ``master_dtype``, the master values: the original ones).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._checkpoint import SafetensorsSource, open_source
from torchsurgery._swap import swap_blocker, swap_in, wrap_like
from torchsurgery.compact import (
    OffloadedTensor,
    ReadContext,
    Scaled,
    Scratch,
    converted_by,
    offloaded_like,
    own_scale,
    reads_elsewhere_only,
    stored_state,
    stored_values,
)
from torchsurgery.compact.scaled import dequantize
from torchsurgery.offloading.device import OffloadDevice
from torchsurgery.offloading.packing import FlatLayout, pack_runs, unpack
from torchsurgery.offloading.plan import (
    DEFAULT_SKIP,
    GroupPlan,
    OffloadPlan,
    ParamPlan,
    Residency,
    _param,
    plan_converted,
    reads_as_computed,
    reads_elsewhere,
    sizes,
)
from torchsurgery.offloading.planner import plan_residency
from torchsurgery.offloading.stats import OffloadStats
from torchsurgery.offloading.streams import (
    PackedGroup,
    _AfterFirst,
    _EndForward,
    _GroupStreamer,
    _StartForward,
    _StreamedGroup,
    _Streaming,
)
from torchsurgery.patching import is_patched, patch, unpatch

__all__ = ["offload", "OffloadHandle", "OffloadStats", "DEFAULT_SKIP"]

_WHAT = "torchsurgery.offload"
_STORAGE_DEVICE = torch.device("cpu")

_Entry = tuple[nn.Module, str, nn.Parameter, torch.dtype]  # (owner, attribute, parameter, compute dtype)


@dataclass(eq=False)
class _Original:
    """Where a tensor was before the offload, and where its values are if it became meta."""

    name: str
    tensor: torch.Tensor
    device: torch.device
    dtype: torch.dtype
    file_key: str | None = None
    kept: torch.dtype | None = None  # the dtype its values were kept in, where it read as another (an installer's)
    kept_on: torch.device | None = None  # the device its values were kept on, where it read as another


class OffloadRecord(_undo.Record):
    """The undo-log entry of an offloaded model."""

    kind = "offload"

    def __init__(self, handle: OffloadHandle) -> None:
        super().__init__()
        self.handle = handle

    def describe(self) -> str:
        s = self.handle.stats()
        return f"offload to {self.handle.device} ({len(s.streamed_groups)} streamed, {len(s.resident_groups)} resident groups)"

    def undo(self, module: nn.Module) -> None:
        self.handle.remove()


def _made_meta(tensor: torch.Tensor, p: ParamPlan) -> bool:
    """Whether a weight the checkpoint file holds is swapped for a meta one: no values, read as it computes."""
    return not tensor.is_meta or tensor.dtype != p.compute_dtype


def _moved(
    tensor: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
    pin: OffloadDevice | None = None,
    data: torch.Tensor | None = None,
) -> torch.Tensor:
    """What to swap into ``tensor`` to give it its values (or ``data``'s) on ``device`` in ``dtype``."""
    data = (tensor if data is None else data).detach().to(device=device, dtype=dtype, copy=True)
    if pin is not None and data.device.type == "cpu":
        data = pin.pin(data)
    return wrap_like(tensor, data)


def _packed_scaled(p: ParamPlan) -> bool:
    """Whether ``p`` is a scaled weight packed into its group's host buffers (wrapped as it is packed)."""
    return p.scaled is not None and p.residency is Residency.STREAMED


def _gone() -> None:
    """The model of a handle that no longer refers to one."""
    return None


class OffloadHandle:
    """An offloaded model: its plan, its statistics, and the exact undo.

    Made by :func:`offload`, which installs :attr:`plan` through it. Also a context
    manager: the offload is removed when the block exits.

    Attributes:
        device: where it computes.
        plan: the :class:`~torchsurgery.offloading.plan.OffloadPlan` that was installed
            (groups made resident after the first forward show in :meth:`stats`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(4, 4))
        >>> weight = model[0].weight
        >>> handle = torchsurgery.offload(model, storage_dtype=torch.float16, dtype=torch.float32)
        >>> handle.active, weight.dtype, weight.stored.dtype, handle.plan.params[0].residency.value
        (True, torch.float32, torch.float16, 'narrow')
        >>> handle.remove() is model, model[0].weight is weight, weight.dtype
        (True, True, torch.float32)
    """

    def __init__(self, model: nn.Module, plan: OffloadPlan, options: dict[str, Any] | None = None) -> None:
        self._model: nn.Module | None = model  # held while the offload is active
        self._model_ref: Callable[[], nn.Module | None] = weakref.ref(model)
        self.plan = plan
        # what offload() was given, and the dtypes the user converted parameters to since
        # (by id): a conversion plans the offload again with both
        self._options: dict[str, Any] = dict(options or {})
        self.converted: dict[int, torch.dtype] = {}
        self.device = plan.device
        self._seam = plan.offload_device
        self._stats = OffloadStats()
        self._streaming = _Streaming(self._seam, self._stats, plan.prefetch)
        self._patched: list[nn.Module] = []
        self._originals: list[_Original] = []  # every tensor the offload changed, in order
        self._reader: SafetensorsSource | None = None
        # the checkpoint's scaled fp8 weights (ComfyUI's layout): file key -> its scale's key
        self._file_scales = {p.file_key: p.file_scale for p in self.plan.params if p.file_key and p.file_scale}
        self._hooks: list[Any] = []
        self._reads = ReadContext(self._stats, Scratch())
        self._hold: _undo.Hold | None = None
        self._record: OffloadRecord | None = None
        self._modules: dict[str, nn.Module] = {}  # by qualified name, while installing
        self._pending: weakref.WeakSet[_Pending] = weakref.WeakSet()  # backwards still to run through the weights
        self._remembered: set[int] = set()  # ids of the tensors in _originals, while installing

    @property
    def model(self) -> nn.Module | None:
        """The offloaded model. A removed handle does not keep it alive: after :meth:`remove`,
        the model while something else refers to it, else ``None``."""
        return self._model if self._model is not None else self._model_ref()

    @property
    def _live(self) -> nn.Module:
        """The model, while the handle holds it (installing, active, removing)."""
        assert self._model is not None, "the handle is removed"
        return self._model

    def __getstate__(self) -> dict[str, Any]:
        # copied with its model (the undo log holds it): weak references do not pickle, and
        # the copy's weights are new objects, in no graph
        return {k: v for k, v in self.__dict__.items() if k not in ("_model_ref", "_pending")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._model_ref = weakref.ref(self._model) if self._model is not None else _gone
        self._pending = weakref.WeakSet()

    def stats(self) -> OffloadStats:
        """A snapshot of the statistics (waits for the timing events of the groups that ran)."""
        streaming, s = self._streaming, self._stats
        hint = streaming.hint()
        order = streaming.order.recorded
        costs, bandwidth = streaming.measured(list(dict.fromkeys(order)))
        ring = streaming.ring
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
            widened_bytes=self._reads.scratch.nbytes(),
        )

    @property
    def active(self) -> bool:
        """Whether the offload is still in place."""
        return self._record is not None

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            self.remove()

    # ------------------------------------------------------------------ install

    def _install(self) -> None:
        """Install :attr:`plan` on the model; on any failure, undo what was done and raise."""
        self._modules = dict(self._live.named_modules())
        try:
            if self.plan.storage is not None:
                source = open_source(self.plan.storage, _WHAT)
                assert isinstance(source, SafetensorsSource)  # the plan checked it
                self._reader = source
                self._check_file_holds()
            self._convert()
            for group in self.plan.groups:
                if not group.resident:
                    self._stream(group)
            self._streaming.start()
            self._read_as_computed()
        except BaseException:
            self._record = OffloadRecord(self)
            _undo.push(self._live, self._record)
            self.remove()
            raise
        finally:
            self._remembered = set()
        self._finish()
        self._modules = {}

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
                tensor = _param(self._modules, p)
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
        target = self.plan.device
        moves = [(p.name, t, to, dtype, pin) for p, t, to, dtype, pin in self._conversions() if not t.is_meta]
        seen: set[int] = set()
        for module in self._live.modules():
            for bname, b in module._buffers.items():
                if b is not None and b.device != target and id(b) not in seen:
                    seen.add(id(b))
                    moves.append((bname, b, target, b.dtype, False))
        swapped = [(name, t) for name, t, to, dtype, _ in moves if t.device != to or t.dtype != dtype]
        swapped += [(p.name, _param(self._modules, p)) for p in self.plan.params if self._wrapped(p)]
        if self._reader is not None:
            files = [(p, _param(self._modules, p)) for p in self.plan.params if p.residency is Residency.FILE]
            swapped += [(p.name, t) for p, t in files if _made_meta(t, p)]
        for name, tensor in swapped:
            problem = swap_blocker(name, tensor, None, _WHAT, weak_references_ok=True)
            if problem:
                raise RuntimeError(problem)
        for p, tensor, to, dtype, _ in self._conversions():
            if tensor.is_meta and p.file_key is not None:  # resident, its values only in the file
                assert self._reader is not None
                self._remember(p.name, tensor)
                swap_in(tensor, _moved(tensor, to, dtype, data=self._from_file(p.file_key)))
        for name, tensor, to, dtype, pin in moves:
            if tensor.device != to or tensor.dtype != dtype or (pin and not self._seam.is_pinned(tensor)):
                self._remember(name, tensor)
                swap_in(tensor, _moved(tensor, to, dtype, pin=self._seam if pin else None))

    def _take_stored_values(self) -> None:
        """Weights that only read as another device (an installer's) hold their stored values, plain, from here on.

        The plan took them as those values; ``remove()`` makes them read as they did again.
        """
        lowered = [(p.name, t) for p in self.plan.params if reads_elsewhere_only(t := _param(self._modules, p))]
        for name, tensor in lowered:
            problem = swap_blocker(name, tensor, None, _WHAT, weak_references_ok=True)
            if problem:
                raise RuntimeError(problem)
        for name, tensor in lowered:
            self._remember(name, tensor)
            swap_in(tensor, wrap_like(tensor, stored_values(tensor)))

    def _remember(self, name: str, tensor: torch.Tensor, file_key: str | None = None) -> None:
        if id(tensor) not in self._remembered:
            self._remembered.add(id(tensor))
            wrapped = isinstance(tensor, OffloadedTensor)
            kept, kept_on = (stored_values(tensor).dtype, stored_values(tensor).device) if wrapped else (None, None)
            self._originals.append(_Original(name, tensor, tensor.device, tensor.dtype, file_key, kept, kept_on))

    def _stream(self, group: GroupPlan) -> None:
        """Patch the group's root module to bring its streamed weights in (and its narrow layers)."""
        packable: list[tuple[_Entry, ParamPlan]] = []
        others: list[tuple[_Entry, ParamPlan]] = []
        for p in group.params:
            owner = self._modules[p.module]
            entry = (owner, p.attr, _param(self._modules, p), p.compute_dtype)
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
        streamer = _GroupStreamer(group.name, entries, [entry for entry, _ in others], packed, self._streaming, narrow)
        module = self._modules[group.name]
        patch(module, _StreamedGroup, streamer)
        _undo.records(module)[-1].internal = True
        self._patched.append(module)

    def _wrapped(self, p: ParamPlan) -> bool:
        """Whether ``p`` becomes an OffloadedTensor: kept in another dtype, or away from the device it computes on."""
        return reads_as_computed(p) or reads_elsewhere(p, self.device)

    def _read_as_computed(self) -> None:
        """Weights kept in another dtype or place than they compute in become OffloadedTensors (same objects).

        They then read as the compute dtype and device everywhere (``weight.dtype``,
        ``model.dtype``, ``model.device``, code inside and outside forwards), and
        ``state_dict()`` shows their stored values.
        """
        owners: dict[int, nn.Module] = {}
        for p in filter(self._wrapped, self.plan.params):
            tensor = _param(self._modules, p)
            if not _packed_scaled(p):  # those were wrapped as they were packed
                self._remember(p.name, tensor)
                swap_in(tensor, self._wrapper(tensor, p, tensor.detach()))
            owner = self._modules[p.module]
            owners[id(owner)] = owner
        for owner in owners.values():
            self._hooks.append(owner.register_state_dict_post_hook(stored_state))

    def _wrapper(
        self, tensor: torch.Tensor, p: ParamPlan, stored: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """What to swap into ``tensor`` to give it the values ``stored`` (in ``p``'s storage dtype; a scaled
        weight's ``q`` with its ``scale``), read as it computes (on the device it computes on, where the
        values stay on the host)."""
        device = self.device if reads_elsewhere(p, self.device) else None
        if p.scaled is not None and scale is None:  # ``stored`` holds the values to quantise (compact/scaled.py)
            stored, scale = p.scaled.quantize(stored)
        return offloaded_like(
            tensor, stored, p.compute_dtype, reads=self._reads, shadow_dtype=p.shadow_dtype, device=device, scale=scale
        )

    def _pack(self, group: GroupPlan, packable: list[tuple[_Entry, ParamPlan]]) -> PackedGroup:
        """The group's streamed weights in host buffers (their only host copy), or left in the file."""
        params = [param for (_, _, param, _), _ in packable]
        planned = [p for _, p in packable]
        if self._reader is not None:
            # the weights stay in the file: the parameters become meta (same objects); the
            # file was proven to hold their values (remove() reads them back from it)
            keys = tuple(str(p.file_key) for p in planned)
            layout = FlatLayout.of(params, [p.storage_dtype for p in planned])
            for param, p in zip(params, planned, strict=True):
                self._remember(p.name, param, p.file_key)
                if _made_meta(param, p):
                    meta = torch.empty_like(param, device="meta", dtype=p.compute_dtype)
                    swap_in(param, wrap_like(param, meta))
            scales = tuple(None if p.file_scale is None else self._file_scale(p.file_scale) for p in planned)
            packed = PackedGroup(group.name, layout, source=self._reader, keys=keys, scales=scales)
        else:
            packed = self._pack_in_memory(group.name, params, planned)
        self._streaming.add(packed)
        return packed

    def _file_scale(self, key: str) -> torch.Tensor:
        """The scale stored under ``key`` (ComfyUI's scaled fp8 layout), fp32, 0-dim, in host memory."""
        assert self._reader is not None
        return self._reader.read(key).float().reshape(())

    def _from_file(self, key: str) -> torch.Tensor:
        """The values the checkpoint holds under ``key``: a scaled fp8 weight's as ``q * scale`` (fp32)."""
        assert self._reader is not None
        scale = self._file_scales.get(key)
        values = self._reader.read(key)
        return values if scale is None else dequantize(values, self._file_scale(scale), torch.float32)

    def _pack_in_memory(self, name: str, params: list[nn.Parameter], planned: list[ParamPlan]) -> PackedGroup:
        """The group's weights in host buffers, one per dtype run, the parameters views of them.

        A scaled weight is quantised and wrapped to read as it computes first; its ``q`` takes
        its slot, its scale one after every weight's values (the ring carries both).
        """
        for param, p in zip(params, planned, strict=True):
            self._remember(p.name, param)
            if p.scaled is not None and not isinstance(param, OffloadedTensor):  # once, if tied within the group
                swap_in(param, self._wrapper(param, p, param.detach()))
        scaled = [t for t in {id(t): t for t in params}.values() if isinstance(t, OffloadedTensor) and own_scale(t) is not None]
        values = [stored_values(t) for t in params]
        scales = [s for s in map(own_scale, scaled) if s is not None]
        layout = FlatLayout.of(values + scales)
        pinned = self.plan.pin_memory
        allocate = self._seam.pinned_empty if pinned else functools.partial(torch.empty, dtype=torch.uint8)
        views = pack_runs(values + scales, layout, allocate)
        for param, view in zip(params, views, strict=False):  # the scales' views follow
            if isinstance(param, OffloadedTensor):
                param._rehome(view)
            else:
                param.data = view
        for param, view in zip(scaled, views[len(values):], strict=True):
            param._rehome_scale(view)
        return PackedGroup(name, layout, tensors=tuple(params), pinned=pinned, scaled=tuple(scaled))

    def _check_file_holds(self) -> None:
        """Refuse a checkpoint whose values differ from the model's own (a stale or other file).

        A weight with values is about to become ``meta``, and ``remove()`` would read it back
        from the file: before anything changes, the file must be proven to give back exactly
        what the model holds.
        """
        assert self._reader is not None
        for p in self.plan.params:
            param = _param(self._modules, p)
            if p.residency is not Residency.FILE or p.tied_to is not None or param.is_meta:
                continue
            stored = self._from_file(str(p.file_key)).to(param.dtype)
            if stored.shape != param.shape or not _same_bytes(stored, param.detach()):
                raise ValueError(
                    f"{_WHAT}: {self.plan.storage!r} holds other values than the model for {p.name!r} "
                    f"(key {p.file_key!r}; a stale or different checkpoint, or one saved in a narrower dtype): "
                    "the model's own values would be lost when the offload is removed. Save the model's weights "
                    "to the file first, or offload without storage="
                )

    def _finish(self) -> None:
        """Statistics, the end-of-forward hook, the hold on the parameters, the undo record."""
        plan, stats, model = self.plan, self._stats, self._live
        stats.resident_groups = [g.name for g in plan.groups if g.resident]
        stats.streamed_groups = [g.name for g in plan.groups if not g.resident]
        stats.resident_bytes = sum(g.nbytes for g in plan.groups if g.resident)
        stats.peak_device_bytes = stats.resident_bytes
        if any(is_patched(m, _StreamedGroup) for m in self._patched):
            # one thread at a time runs the model; the order streamed groups ran in is closed at
            # the end of every forward, after the first one's measurements chose residency
            streaming = self._streaming
            self._hooks.append(model.register_forward_pre_hook(_StartForward(streaming), prepend=True))
            if plan.measured_budget is not None:
                self._hooks.append(model.register_forward_hook(_AfterFirst(streaming, self._plan_from_measurements)))
            self._hooks.append(model.register_forward_hook(_EndForward(streaming), always_call=True))
        # forwards that record gradients: the backward each leaves pending through the weights
        self._hooks.append(model.register_forward_hook(_WatchBackward(self), always_call=True))
        self._hold = _undo.hold([_param(self._modules, p) for p in plan.params], "an active offload")
        for name, module in self._modules.items():
            # .to(), .half(), .cuda()... would change weights whose values live in this offload
            # behind its back: refused, before anything changes (the instance attribute wins
            # over the class method; removed with the offload)
            if "_apply" not in module.__dict__:
                module.__dict__["_apply"] = _Conversion(module, name, self)
        self._record = OffloadRecord(self)
        _undo.push(model, self._record)

    # ------------------------------------------------------------------ after the first forward

    def _plan_from_measurements(self) -> None:
        """After the first forward: keep resident the ring groups whose transfers stall most.

        Counted as :meth:`~torchsurgery.offloading.plan.OffloadPlan.device_bytes` counts the
        budget: the groups resident, next to a ring sized for the groups that still stream.
        The ring is freed first, every chosen group's values are put on the device, then
        swapped in: an allocation that fails (out of memory) leaves every group streaming
        and the ring is made again by the next forward (after which this runs again).
        """
        streaming, plan = self._streaming, self.plan
        budget = plan.budget
        if plan.measured_budget is None or budget is None or self._record is None:
            return
        resident = set(self._stats.resident_groups)
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
        for name, swaps in values:
            self._make_resident(name, swaps)
        streaming.start()

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
        streamer = self._live.get_submodule(name).__dict__["_offload_streamer"]
        packed = self._streaming.packed.get(name)
        values: dict[int, torch.Tensor] = {}
        if packed is not None and packed.from_file:
            # the group streams from the checkpoint file (its parameters are meta): read it once
            buffer = torch.empty(packed.layout.nbytes, dtype=torch.uint8)
            packed.fill(buffer)
            views = [v if s is None else dequantize(v, s, torch.float32) for v, s in packed.scaled_views(unpack(buffer, packed.layout))]
            values = {id(p): v for (_, _, p, _), v in zip(streamer.packed_entries, views, strict=True)}
        planned = {id(p.lookup(self._live)): p for p in self.plan.params if p.tied_to is None}
        swaps = []
        for _, _, p, dtype in streamer.packed_entries + streamer.other_entries:
            q = planned[id(p)]
            self._remember(q.name, p)  # remove() gives it back (one that needed no move to start streaming too)
            if reads_as_computed(q):
                scale = own_scale(p)  # a scaled weight's moves with it
                kept = stored_values(p).detach().to(self.device, q.storage_dtype, copy=True)
                swaps.append((p, self._wrapper(p, q, kept, None if scale is None else scale.to(self.device, copy=True))))
            else:
                swaps.append((p, _moved(p, self.device, dtype, data=values.get(id(p)))))
        return swaps

    def _make_resident(self, name: str, swaps: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Group ``name`` keeps its weights on the device from now on (``swaps``: see :meth:`_resident_values`)."""
        module = self._live.get_submodule(name)
        module.__dict__["_offload_streamer"].resident = True
        self._streaming.stop_streaming(name)
        for tensor, replacement in swaps:
            swap_in(tensor, replacement)
        stats = self._stats
        stats.resident_groups.append(name)
        stats.streamed_groups.remove(name)
        stats.resident_bytes += next(g.nbytes for g in self.plan.groups if g.name == name)

    # ------------------------------------------------------------------ conversions

    def _convert_subtree(self, module: nn.Module, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``module.to(dtype)``, ``.half()``, ``.float()``... while offloaded, taken as the plain module takes it.

        ``fn`` is what the conversion applies to every tensor; it is shown each parameter as
        the parameter reads (its compute dtype, on the device it computes on) and each buffer.
        A move to another device is refused, one to the device the model computes on is
        nothing. Where dtypes change, the offload is planned again with those parameters
        computing in their new dtype (sizes, residency, ring slots, casts follow; a model kept
        whole stays whole) and their values those of the plain module converted the same way:
        read as they computed, then converted (widening is exact, and a narrower storage dtype
        is kept; narrowing rounds). The conversion is the user's: :meth:`remove` gives the
        module back in the dtypes it was converted to.

        Raises:
            RuntimeError: a move to another device; a model streamed from a checkpoint file;
                a conversion while a streamed group runs (inside its forward). Nothing changed.
        """
        label = f"{name or '<root>'} ({type(module).__name__})"
        changes: dict[int, tuple[torch.Tensor, torch.dtype, torch.dtype]] = {}  # tensor, read as, converted to
        with torch.no_grad():
            for qual, t in [*module.named_parameters(), *module.named_buffers()]:
                shown = torch.empty(0, dtype=t.dtype, device=self.device if isinstance(t, nn.Parameter) else t.device)
                after = fn(shown)
                if after.device != shown.device:
                    raise RuntimeError(
                        f"{_WHAT}: cannot move {label} to {after.device} while it is offloaded to {self.device} "
                        f"({qual!r} computes there; its weights live in the offload's storage): remove the offload "
                        "first (handle.remove() or torchsurgery.restore(model)) and offload to the new device; "
                        ".to(dtype) alone is taken while offloaded"
                    )
                if after.dtype != t.dtype:
                    changes[id(t)] = (t, t.dtype, after.dtype)
                elif after is not shown:  # new values of the same dtype (to_empty): none to keep in storage
                    raise RuntimeError(
                        f"{_WHAT}: cannot convert {label} with a conversion that gives {qual!r} new values while it "
                        "is offloaded (its weights live in the offload's storage): remove the offload first "
                        "(handle.remove() or torchsurgery.restore(model))"
                    )
        if not changes:
            return
        if self.plan.storage is not None:
            raise RuntimeError(
                f"{_WHAT}: cannot convert {label} to another dtype while it is streamed from {self.plan.storage!r}: "
                "its weights are read in the file's dtypes. Remove the offload first, or give offload() dtype="
            )
        running = [m for m in self._patched if m.__dict__["_offload_streamer"].depth > 0]
        if running:
            group = next(n for n, m in self._live.named_modules() if m is running[0])
            raise RuntimeError(
                f"{_WHAT}: cannot convert {label} while the streamed group {group or '<root>'!r} runs (inside its "
                "forward its weights are in use): convert before or after the group's forward"
            )
        params = {id(p) for p in module.parameters()}
        converted = {**self.converted, **{k: d for k, (_, _, d) in changes.items() if k in params}}
        options, model, whole = dict(self._options), self._live, all(g.resident for g in self.plan.groups)
        if whole and options.get("budget") is not None:
            # kept whole, as the plain module would be: the budget grows by what the conversion adds
            o = options
            grown, _, _ = sizes(model, _WHAT, dtype=o["dtype"], storage_dtype=o["storage_dtype"], groups=o["groups"],
                                skip=o["skip"], converted=converted, device=self._seam, prefetch=self.plan.prefetch)
            options["budget"] = max(int(options["budget"]), grown)
        # the converted model must be offloadable again within the budget: checked before
        # anything changes (a refusal leaves the model as it was, offloaded)
        plan_converted(model, self._seam, converted, offloaded_ok=True, **options)
        self.remove()
        with torch.no_grad():
            for t, read_as, dtype in changes.values():
                if not isinstance(t, OffloadedTensor):
                    # as the offloaded module read it (the compute dtype), then converted
                    swap_in(t, wrap_like(t, t.detach().to(read_as).to(dtype)), pending_backward_ok=True)
            # weights that read as another dtype or device than they keep (an installer's): as
            # their own modules convert them, so that they go on reading as installed
            for m in module.modules():
                if any(isinstance(t, OffloadedTensor) and id(t) in changes for t in [*m._parameters.values(), *m._buffers.values()]):
                    m._apply(fn, recurse=False)
        # planned and installed again on this handle, so that references to it stay valid
        OffloadHandle.__init__(self, model, plan_converted(model, self._seam, converted, **options), options)
        self.converted = converted
        self._install()

    # ------------------------------------------------------------------ undo

    def remove(self) -> nn.Module:
        """Undo the offload: hooks and patches off, every tensor back where it was.

        Each parameter is the same object again, on its device in its dtype. Its values are
        those it was stored with: rounded to ``storage_dtype`` where that is narrower
        (resident or streamed alike), the master values with a ``master_dtype``.

        All or nothing: every value to put back is read (from the checkpoint file, for
        weights streamed from one) and converted first; if that fails (a file cut short,
        out of memory), the model, its hooks and its log are exactly as before and the error
        says why. While the graph of a forward that recorded gradients holds a weight the
        offload gives back (its backward is pending), the removal is refused, changing
        nothing: giving the weight back would leave that backward nowhere to put its
        gradient. Run the backward, or drop its outputs, first.

        The handle then holds neither the model (see :attr:`model`) nor device memory.

        Returns:
            The model.

        Raises:
            RuntimeError: another thread is running the model, or a backward through its
                offloaded weights is pending; nothing changed. Or the handle was removed
                already and its model freed since.
            torchsurgery.CheckpointError: the checkpoint file can no longer give back a
                weight it holds; nothing changed.
        """
        if self._record is None:
            model = self.model
            if model is None:
                raise RuntimeError(f"{_WHAT}.remove: this offload was removed and its model freed since; nothing to remove")
            return model
        model = self._live
        _undo.check_idle(model, f"{_WHAT}.remove")
        self._check_no_pending_backward()
        # copies still in flight write into the ring's buffers and read the host buffers:
        # the ring goes once they have landed, before either is released (a removal that
        # then fails leaves the next forward to make a new ring)
        self._streaming.drop_ring()
        restored = self._restored_values()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module in reversed(self._patched):
            if is_patched(module, _StreamedGroup):
                unpatch(module, _StreamedGroup, _internal=True)
        self._patched.clear()
        for tensor, replacement in restored:
            # a graph whose backward ran (or was dropped) may still be referenced by live
            # outputs without holding the weights: nothing to wait for
            swap_in(tensor, replacement, pending_backward_ok=True)
        # surgery applied after the offload (an installation over a loaded model) gives back
        # these values when it is undone, not the device copies it saw
        _undo.rebase_saved(model, self._record, [tensor for tensor, _ in restored])
        self._originals.clear()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._reads.scratch.clear()
        self._streaming.close()
        if self._hold is not None:
            _undo.release(self._hold)
            self._hold = None
        for module in self._live.modules():
            if isinstance(module.__dict__.get("_apply"), _Conversion):
                del module.__dict__["_apply"]
        _undo.remove(model, self._record)
        self._record = None
        self._model = None  # a removed handle does not keep the model alive
        return model

    def _watch_backward(self) -> None:
        """After a forward that recorded gradients: mark the backward it left pending through
        the weights :meth:`remove` gives back, on their gradient accumulators.

        The mark goes when that backward reaches the accumulator, or with the graph.
        """
        for o in self._originals:
            tensor = o.tensor
            if not tensor.requires_grad or tensor._use_count() < 2:  # type: ignore[attr-defined]
                continue  # in no graph (one holder: the object itself)
            node = torch.autograd.graph.get_gradient_edge(tensor).node
            metadata: dict[str, Any] = node.metadata  # type: ignore[assignment]  # a property, typed as a method
            mark = metadata.get(_PENDING_KEY)
            if mark is None or mark not in self._pending:
                mark = _Pending(o.name)
                metadata[_PENDING_KEY] = mark
                self._pending.add(mark)
                node.register_prehook(functools.partial(_backward_ran, self._pending, weakref.ref(mark)))

    def _check_no_pending_backward(self) -> None:
        """Refuse to give back weights that the graph of a pending backward accumulates into."""
        found = [mark.name for mark in self._pending][:1]  # names only: the error's traceback keeps its frame's locals
        if found:
            owner = type(self._live).__name__
            raise RuntimeError(
                f"{_WHAT}.remove: cannot remove the offload of the {owner} while a backward through its offloaded "
                f"weight {found[0]!r} is pending: the weight is held elsewhere, by the graph of a forward that "
                "recorded gradients, and giving it back would leave that backward no weight to put its gradient in. "
                "Run the backward (loss.backward()) or drop the graph (del the outputs and the loss), then remove "
                "the offload; nothing was changed"
            )

    def _restored_values(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each changed tensor with what is swapped back into it: its values on its device, in its
        dtype (kept as they were kept where it read as another dtype); changes nothing."""
        restored: list[tuple[torch.Tensor, torch.Tensor]] = []
        for o in reversed(self._originals):
            tensor, dtype = o.tensor, o.kept or o.dtype
            meta = stored_values(tensor).is_meta
            if meta and o.device.type == "meta":  # a skeleton's weight: meta it was, meta it stays
                if isinstance(tensor, OffloadedTensor):  # it read as the device it computed on
                    restored.append((tensor, wrap_like(tensor, torch.empty(tensor.shape, dtype=o.dtype, device="meta"))))
                continue
            where = o.kept_on or o.device
            if meta:  # its values are in the checkpoint file it was streamed from
                assert self._reader is not None and o.file_key is not None
                data = self._from_file(o.file_key).to(device=where, dtype=dtype)
            else:
                data = tensor.detach().to(device=where, dtype=dtype, copy=True)
            back = wrap_like(tensor, data) if o.kept is None else offloaded_like(tensor, data, o.dtype, device=o.device)
            restored.append((tensor, back))
        return restored


_PENDING_KEY = "torchsurgery_offload_pending"


class _Pending:
    """The mark of a pending backward, on the gradient accumulator of the weight ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name


def _backward_ran(pending: weakref.WeakSet[_Pending], mark: weakref.ref[_Pending], grad: Any) -> None:
    found = mark()
    if found is not None:
        pending.discard(found)


class _WatchBackward:
    """A forward hook on the offloaded model (also when the forward raised): after a forward that
    recorded gradients, the handle marks the backward it left pending (picklable)."""

    def __init__(self, handle: OffloadHandle) -> None:
        self.handle = handle

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self.handle._watch_backward()


class _Conversion:
    """Stands in for ``Module._apply`` on an offloaded module: ``.to(dtype)``, ``.half()``... go through the offload.

    A conversion that changes no tensor (``.to("cpu")`` of a model offloaded on the CPU, ``.to(device)``
    to the device the model computes on) does nothing; a dtype conversion is taken as the plain
    module takes it (:meth:`OffloadHandle._convert_subtree`); a move to another device is refused.
    A copy of the model (``deepcopy``, ``pickle``) carries no offload: its copy refuses conversions.
    """

    def __init__(self, module: nn.Module, name: str, handle: OffloadHandle | None = None) -> None:
        self.module = module
        self.name = name
        self.handle = weakref.ref(handle) if handle is not None else None

    def __getstate__(self) -> dict[str, Any]:
        return {"module": self.module, "name": self.name, "handle": None}

    def __call__(self, fn: Any, recurse: bool = True) -> nn.Module:
        changed = converted_by(self.module, fn)
        if changed is None:  # nothing changes (share_memory_, .to() where it already is): as on the plain module
            return nn.Module._apply(self.module, fn, recurse)
        handle = self.handle() if self.handle is not None else None
        if handle is not None and handle.active:
            handle._convert_subtree(self.module, self.name, fn)
            return self.module
        where = f"{self.name}.{changed}" if self.name else changed
        raise RuntimeError(
            f"{_WHAT}: cannot convert {self.name or '<root>'} ({type(self.module).__name__}) with .to(), .half() "
            f"or the like ({where!r} would change): it is a copy of an offloaded module, whose weights live in "
            "the original's offload. Remove the offload before copying (handle.remove() or torchsurgery.restore(model))"
        )


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bits (NaNs included)."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True


def offload(
    model: nn.Module,
    device: str | torch.device | OffloadDevice = "cpu",
    *,
    dtype: torch.dtype | None = None,
    storage_dtype: torch.dtype | Scaled | None = None,
    budget: int | None = None,
    prefetch: int = 1,
    pin_memory: bool | None = None,
    groups: str | Sequence[str] = "blocks",
    skip: Callable[[nn.Module, str], bool] | None = DEFAULT_SKIP,
    master_dtype: torch.dtype | None = None,
    storage: str | os.PathLike[str] | None = None,
) -> OffloadHandle:
    """Keep ``model``'s weights in storage and bring each group in just before it runs.

    Args:
        model: the model (changed in place; nothing is copied).
        device: where the computation runs: ``"cpu"``, a device of the accelerator this
            PyTorch reports (``"cuda"``, ``"xpu"``, ``"mps"``, ...) or an ``OffloadDevice``.
        dtype: the compute dtype of floating weights (default: their current dtype).
        storage_dtype: the dtype weights are stored in, resident or streamed, whatever the
            budget (``bfloat16``, ``float16``, ``float8_e4m3fn``, ``float8_e5m2``, ``float32``,
            ``float64``); modules selected by ``skip`` keep theirs. Or a scaled format,
            :class:`~torchsurgery.compact.Scaled` (fp8 or int8 values with an fp32 scale per
            output channel or per tensor) for weights of two or more dimensions, resident or
            streamed: biases keep the compute dtype.
        budget: device bytes the weights may take as stored, next to the ``prefetch + 1``
            largest streamed groups in flight. A model that fits is kept whole. Otherwise the
            groups that stream through the ring are measured on the first forward and
            those whose transfers cannot be hidden behind compute are kept resident
            (:func:`~torchsurgery.offloading.planner.plan_residency`); groups served by the
            CPU narrow-weight path are filled in execution order. ``None``: nothing is
            resident on a CPU; on an accelerator, what is free minus a margin.
        prefetch: how many groups ahead to bring in (in the first forward's order).
        pin_memory: pin host storage (default: on an accelerator that can).
        groups: ``"blocks"``, ``"leaves"`` or a list of qualified module names.
        skip: ``(module, name) -> bool``; selected modules keep their own dtype.
        master_dtype: for training: the parameters themselves stay in this dtype (what
            the optimizer updates and gradients land in) and the engine keeps a
            ``storage_dtype`` copy for forwards without gradients, refreshed whenever a
            parameter changes (a resident weight holds both). It must hold the values
            exactly, so ``remove()`` gives them back; ``None``: they keep the rounding.
        storage: a safetensors checkpoint (file, sharded ``*.index.json`` or folder) with
            the model's weights under its ``state_dict`` names: streamed groups are then
            read from it on demand instead of being held in memory (for models larger than
            RAM; inference only). The parameters are ``meta`` while offloaded; a model built
            with :func:`~torchsurgery.skeleton` can be offloaded straight from its file. The
            weights are then stored in the file's dtypes (no ``storage_dtype``).

    Returns:
        An :class:`OffloadHandle` (``plan``, ``stats()``, ``remove()``, context manager).
        :func:`~torchsurgery.plan_offload` with the same arguments shows the plan without
        installing it.

    Raises:
        TypeError: an argument of the wrong kind; a storage or master dtype weights cannot
            be kept in (exactly, for the master); or a module to keep in another dtype
            carries a patch that reads weight memory directly (``__patch_needs_plain_weights__``).
        ValueError: a device that does not exist, ``pin_memory=True`` where host memory
            cannot be pinned, a budget below the largest group, an unknown group name, a
            ``storage_dtype`` with a checkpoint ``storage``.
        RuntimeError: the model is already offloaded (by torchsurgery, accelerate or diffusers).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
        >>> x = torch.randn(2, 8)
        >>> expected = model(x).detach()
        >>> with torchsurgery.offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32) as handle:
        ...     torch.allclose(model(x), expected, atol=0.05), model[0].weight.dtype, model[0].weight.stored.dtype
        (True, torch.float32, torch.bfloat16)
    """
    options = {"dtype": dtype, "storage_dtype": storage_dtype, "budget": budget, "prefetch": prefetch,
               "pin_memory": pin_memory, "groups": groups, "skip": skip, "master_dtype": master_dtype,
               "storage": storage}
    return offload_converted(model, device, None, options)


def offload_converted(
    model: nn.Module, device: str | torch.device | OffloadDevice, converted: dict[int, torch.dtype] | None,
    options: dict[str, Any],
) -> OffloadHandle:
    """:func:`offload` with ``options`` (its keywords), the parameters in ``converted`` computing in
    the dtypes the user converted them to (by ``id``; see :meth:`OffloadHandle._convert_subtree`)."""
    plan = plan_converted(model, device, converted, **options)
    handle = OffloadHandle(model, plan, options)
    handle.converted = dict(converted or {})
    handle._install()
    return handle
