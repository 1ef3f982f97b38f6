"""The ``offload`` engine: weights live in storage and come in group by group.

Weights are kept in *storage* (host memory, optionally in a compact ``storage_dtype``, or
a checkpoint file) and brought to ``device``/``dtype`` just before their group runs, then
released. Within a ``budget``, groups whose transfers cannot be hidden behind compute
stay resident instead. With a storage dtype narrower than the compute dtype it is
"layerwise casting" and halves the weights' memory.

Mechanics, chosen so that nothing about the model's identity changes:

* storage and residency conversions swap data into the existing parameter objects
  (``torch.utils.swap_tensors``), so optimizers and user references stay valid;
* a streamed group's weights are packed into one flat host buffer that the parameters
  are views into, and its root module gets a patch whose forward brings the group in
  through a ring of device buffers (:mod:`torchsurgery.offloading.streams`) and puts the
  stored parameters back in a ``finally``, also on ``KeyboardInterrupt``;
* on a CPU, ``nn.Linear`` (and transformers ``Conv1D``) layers stored narrower than they
  compute read the narrow weight directly (:mod:`torchsurgery.offloading.narrow`).

This module plans (groups, residency, dtypes), installs and removes. Everything is
recorded in the model's undo log; :meth:`OffloadHandle.remove` (or ``torchsurgery.restore``)
puts every tensor back on its device in its dtype, with its identity (values are those of
the storage dtype when that was narrower).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._checkpoint import SafetensorsSource, open_source
from torchsurgery._validate import check_bytes, check_dtype
from torchsurgery.errors import BudgetError
from torchsurgery.offloading.device import OffloadDevice, resolve_device
from torchsurgery.offloading.grouping import find_groups
from torchsurgery.offloading.narrow import _is_matmul_layer, _NarrowMatmul, _Scratch, _Shadows
from torchsurgery.offloading.packing import FlatLayout, pack, unpack
from torchsurgery.offloading.planner import plan_residency
from torchsurgery.offloading.stats import OffloadStats
from torchsurgery.offloading.streams import (
    PackedGroup,
    Ring,
    _EndForward,
    _GroupStreamer,
    _Shared,
    _StreamedGroup,
)
from torchsurgery.patching import is_patched, patch, unpatch
from torchsurgery.tensors import _swap_blocker, _wrap_like

__all__ = ["offload", "OffloadHandle", "OffloadStats", "DEFAULT_SKIP"]


def _is_norm_or_embedding(module: nn.Module, name: str) -> bool:
    """Whether ``module`` is a norm or an embedding (kept in its dtype by default).

    Example:
        >>> from torch import nn
        >>> import torchsurgery
        >>> torchsurgery.DEFAULT_SKIP(nn.LayerNorm(4), "ln"), torchsurgery.DEFAULT_SKIP(nn.Linear(2, 2), "fc")
        (True, False)
    """
    norms = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm, nn.Embedding, nn.EmbeddingBag)
    return isinstance(module, norms) or "Norm" in type(module).__name__ or "Embedding" in type(module).__name__


DEFAULT_SKIP: Callable[[nn.Module, str], bool] = _is_norm_or_embedding
"""Modules kept in their own dtype when a ``storage_dtype`` is given: norms and embeddings."""


@dataclass(eq=False)
class _Group:
    name: str
    module: nn.Module
    params: list[tuple[nn.Module, str, nn.Parameter]]
    nbytes: int
    resident: bool = False


# ------------------------------------------------------------------------- the handle


class OffloadRecord(_undo.Record):
    """The undo-log entry of an offloaded model."""

    kind = "offload"

    def __init__(self, handle: OffloadHandle) -> None:
        super().__init__()
        self.handle = handle

    def describe(self) -> str:
        s = self.handle._stats
        return f"offload to {self.handle.device} ({len(s.streamed_groups)} streamed, {len(s.resident_groups)} resident groups)"

    def undo(self, module: nn.Module) -> None:
        self.handle.remove()


class OffloadHandle:
    """An offloaded model: its statistics, and the exact undo.

    Also a context manager: the offload is removed when the block exits.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(4, 4))
        >>> weight = model[0].weight
        >>> handle = torchsurgery.offload(model, storage_dtype=torch.float16, dtype=torch.float32)
        >>> handle.active, weight.dtype
        (True, torch.float16)
        >>> handle.remove() is model, model[0].weight is weight, weight.dtype
        (True, True, torch.float32)
    """

    def __init__(self, model: nn.Module, device: OffloadDevice, prefetch: int = 1) -> None:
        self.model = model
        self.device = device.device
        self._device = device
        self._stats = OffloadStats()
        self._patched: list[nn.Module] = []
        self._originals: list[tuple[torch.Tensor, torch.device, torch.dtype]] = []
        self._transit = _Shared(device, self._stats, prefetch)
        self._planning_budget: int | None = None
        self._reader: SafetensorsSource | None = None
        self._file_keys: dict[int, str] = {}
        self._hooks: list[Any] = []
        self._scratch = _Scratch()
        self._shadows = _Shadows()
        self._pinned: list[int] = []
        self._record: OffloadRecord | None = None

    def stats(self) -> OffloadStats:
        """A snapshot of the statistics (waits for the timing events of the groups that ran)."""
        hint = self._transit.hint()
        s = self._stats
        return dataclasses.replace(
            s, resident_groups=list(s.resident_groups), streamed_groups=list(s.streamed_groups), hint=hint
        )

    @property
    def active(self) -> bool:
        """Whether the offload is still in place."""
        return self._record is not None

    def remove(self) -> nn.Module:
        """Undo the offload: hooks and patches off, every tensor back where it was.

        Returns:
            The model.
        """
        if self._record is None:
            return self.model
        # copies still in flight write into the ring's buffers and read the host buffers:
        # let them land before either is released
        self._device.synchronize()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module in reversed(self._patched):
            for kind in (_NarrowMatmul, _StreamedGroup):
                if is_patched(module, kind):
                    unpatch(module, kind, _internal=True)
        self._patched.clear()
        for tensor, device, dtype in reversed(self._originals):
            if tensor.is_meta and device.type != "meta":
                # its values are in the checkpoint file it was streamed from
                assert self._reader is not None
                value = self._reader.read(self._file_keys[id(tensor)]).to(device=device, dtype=dtype)
                torch.utils.swap_tensors(tensor, _wrap_like(tensor, value))
            elif not (tensor.is_meta and device.type == "meta"):
                _swap_to(tensor, device, dtype)
        self._originals.clear()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._scratch.clear()
        self._transit.ring = None
        self._transit.packed.clear()
        self._shadows.entries.clear()
        _unpin(self._pinned)
        self._pinned.clear()
        _undo.remove(self.model, self._record)
        self._record = None
        return self.model

    def _plan_from_measurements(self) -> None:
        """After the first forward: keep resident the ring groups whose transfers stall most."""
        shared = self._transit
        if self._planning_budget is None or self._record is None:
            return
        names = [n for n in dict.fromkeys(shared.order.recorded) if n in shared.packed]
        costs, bandwidth = shared.measured(names)  # timings read through the device seam
        if not costs:
            return
        for name in plan_residency(costs, self._planning_budget, bandwidth, shared.prefetch):
            self._make_resident(name)

    def _make_resident(self, name: str) -> None:
        module = self.model.get_submodule(name)
        streamer = module.__dict__["_offload_streamer"]
        unpatch(module, _StreamedGroup, _internal=True)
        self._patched.remove(module)
        packed = self._transit.packed.pop(name, None)
        values: dict[int, torch.Tensor] = {}
        if packed is not None and packed.host is None:
            # the group streams from the checkpoint file (its parameters are meta): read it once
            buffer = torch.empty(packed.layout.nbytes, dtype=torch.uint8)
            packed.fill(buffer)
            views = unpack(buffer, packed.layout)
            values = {id(p): v for (_, _, p, _), v in zip(streamer.packed_entries, views, strict=True)}
        for _, _, p, dtype in streamer.packed_entries + streamer.other_entries:
            # same object, now on the device in the compute dtype
            _swap_to(p, self.device, dtype, data=values.get(id(p)))
        ring = self._transit.ring
        if ring is not None:
            ring.holding = [None if g is packed else g for g in ring.holding]
        stats = self._stats
        stats.resident_groups.append(name)
        stats.streamed_groups.remove(name)
        stats.resident_bytes += streamer.nbytes

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _unpin(keys: list[int]) -> None:
    for key in keys:
        _undo.pinned.pop(key, None)


def _swap_to(
    tensor: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
    pin: OffloadDevice | None = None,
    data: torch.Tensor | None = None,
) -> None:
    """Give ``tensor`` (same object) its values (or ``data``'s) on ``device`` in ``dtype``."""
    data = (tensor if data is None else data).detach().to(device=device, dtype=dtype, copy=True)
    if pin is not None and data.device.type == "cpu":
        data = pin.pin(data)
    if type(tensor) in (torch.Tensor, nn.Parameter) and weakref.getweakrefs(tensor):
        # e.g. torch.compile's guards hold weak references, which swap_tensors refuses;
        # for plain tensors, setting .data keeps the object just as well
        tensor.data = data
        return
    torch.utils.swap_tensors(tensor, _wrap_like(tensor, data))


def _already_offloaded(model: nn.Module) -> str | None:
    for name, module in model.named_modules():
        if any(isinstance(r, OffloadRecord) for r in _undo.records(module)):
            return f"it is already offloaded by torchsurgery ({name or '<root>'}); remove() that first"
        if hasattr(module, "_hf_hook"):
            return f"{name or '<root>'} carries an accelerate hook (cpu_offload/dispatch_model); remove it first"
        if getattr(module, "_diffusers_hook", None) is not None:
            return f"{name or '<root>'} carries a diffusers hook (group offloading/layerwise casting); remove it first"
    return None


def offload(
    model: nn.Module,
    device: str | torch.device | OffloadDevice = "cpu",
    *,
    dtype: torch.dtype | None = None,
    storage_dtype: torch.dtype | None = None,
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
        device: where the computation runs: ``"cpu"`` or a device of the accelerator this
            PyTorch reports (``"cuda"``, also for ROCm; ``"xpu"``, ``"mps"``, ...), or an
            :class:`~torchsurgery.offloading.device.OffloadDevice` (e.g. a simulated one).
        dtype: the compute dtype of floating weights (default: their current dtype).
        storage_dtype: the dtype weights are stored in (e.g. ``torch.bfloat16`` or
            ``torch.float8_e4m3fn``); modules selected by ``skip`` keep theirs.
        budget: device bytes the weights may take, next to the ``prefetch + 1`` largest
            streamed groups in flight. A model that fits is kept whole. Otherwise the
            groups that stream through the ring are measured on the first forward and
            those whose transfers cannot be hidden behind compute are kept resident
            (:func:`~torchsurgery.offloading.planner.plan_residency`); groups served by the
            CPU narrow-weight path are filled in execution order. ``None``: nothing is
            resident on a CPU; on an accelerator, what is free minus a margin.
        prefetch: how many groups ahead to bring in, along the order recorded on the
            first forward.
        pin_memory: pin host storage; default: when ``device`` is an accelerator that can.
        groups: ``"blocks"``, ``"leaves"`` or a list of qualified module names.
        skip: ``(module, name) -> bool``; selected modules keep their own dtype.
        master_dtype: for training: the parameters themselves stay in this dtype (what
            the optimizer updates and gradients land in) and the engine keeps a
            ``storage_dtype`` copy for forwards without gradients, refreshed whenever a
            parameter changes. ``None``: the parameters are stored in ``storage_dtype``.
        storage: a safetensors checkpoint (file, sharded ``*.index.json`` or folder) with
            the model's weights under its ``state_dict`` names: streamed groups are then
            read from it on demand instead of being held in memory (for models larger than
            RAM; inference only). The parameters are ``meta`` while offloaded; a model built
            with :func:`~torchsurgery.skeleton` can be offloaded straight from its file.

    Returns:
        An :class:`OffloadHandle` (``stats()``, ``remove()``, context manager).

    Raises:
        TypeError: an argument of the wrong kind.
        ValueError: a device that does not exist, ``pin_memory=True`` where host memory
            cannot be pinned, a budget below the largest group, an unknown group name.
        RuntimeError: the model is already offloaded (by torchsurgery, accelerate or diffusers).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
        >>> x = torch.randn(2, 8)
        >>> expected = model(x).detach()
        >>> with torchsurgery.offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32) as handle:
        ...     torch.allclose(model(x), expected, atol=0.05), model[0].weight.dtype
        (True, torch.bfloat16)
        >>> model[0].weight.dtype
        torch.float32
    """
    what = "torchsurgery.offload"
    _undo.check_not_compiling("offload")
    _undo.check_module(model, what)
    seam = resolve_device(device, what)
    target = seam.device
    compute_dtype = check_dtype(dtype, what, "dtype")
    store_dtype = check_dtype(storage_dtype, what, "storage_dtype")
    master = check_dtype(master_dtype, what, "master_dtype")
    check_bytes(budget, what, "budget")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"{what}: prefetch must be an int >= 0, got {prefetch!r}")
    if skip is not None and not callable(skip):
        raise TypeError(f"{what}: skip must be a filter (module, name) -> bool or None, got {skip!r}")
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise TypeError(f"{what}: pin_memory must be True, False or None (automatic), got {pin_memory!r}")
    problem = _already_offloaded(model)
    if problem:
        raise RuntimeError(f"{what}: cannot offload the model: {problem}")
    if pin_memory and not seam.can_pin:
        raise ValueError(
            f"{what}: pin_memory=True, but host memory cannot be pinned for {str(target)!r} "
            "(page-locked memory needs an accelerator); pass pin_memory=False"
        )
    pin = (not seam.host_compute and seam.can_pin) if pin_memory is None else pin_memory
    storage_device = torch.device("cpu")

    names = find_groups(model, groups, what)
    named = dict(model.named_modules())
    seen: set[int] = set()
    plan: list[_Group] = []
    wants: dict[int, tuple[torch.dtype, torch.dtype]] = {}  # id -> (storage dtype, compute dtype)
    shadowed: dict[int, torch.dtype] = {}  # id -> narrow dtype of the copy kept next to a master
    # each module belongs to the innermost group containing it
    members: dict[str, list[tuple[str, nn.Module]]] = {g: [] for g in names}
    for qual, module in named.items():
        owner_group = max(
            (g for g in names if g == "" or qual == g or qual.startswith(f"{g}.")), key=len, default=None
        )
        if owner_group is not None:
            members[owner_group].append((qual, module))
    # a weight keeps its dtype when any module holding it is skipped (e.g. tied to an embedding)
    kept = {
        id(p) for qual, m in named.items() if skip is not None and skip(m, qual) for p in m.parameters(recurse=False)
    }
    for gname in names:
        group_module = named[gname]
        params: list[tuple[nn.Module, str, nn.Parameter]] = []
        nbytes = 0
        for _, owner in members[gname]:
            for pname, p in owner._parameters.items():
                if p is None:
                    continue
                floating = p.is_floating_point()
                compute = compute_dtype if (compute_dtype is not None and floating) else p.dtype
                stored = store_dtype if (store_dtype is not None and floating and id(p) not in kept) else compute
                if stored != compute and master is not None:
                    shadowed[id(p)] = stored  # the parameter keeps the master dtype; a narrow copy serves forwards
                    stored = master
                if id(p) not in wants:
                    wants[id(p)] = (stored, compute)
                params.append((owner, pname, p))
                if id(p) not in seen:
                    seen.add(id(p))
                    nbytes += p.numel() * compute.itemsize
        if params:
            plan.append(_Group(gname, group_module, params, nbytes))
    if not plan:
        raise ValueError(f"{what}: the model has no parameters to offload")
    if storage is None:
        empty = [f"{g.name}.{n}" if g.name else n for g in plan for _, n, p in g.params if p.is_meta]
        if empty:
            raise ValueError(
                f"{what}: {len(empty)} weights are on the meta device (no values), e.g. {empty[:3]}; "
                "stream them from their checkpoint with storage='model.safetensors', or load them first"
            )

    # residency within the budget (see below); None: nothing to plan from measurements
    planning_budget: int | None = None
    largest = max(g.nbytes for g in plan)
    if budget is None and not seam.host_compute:
        budget = max(0, int(seam.free_memory() * 0.9) - (256 << 20))
    if budget is not None:
        if budget < largest:
            big = max(plan, key=lambda g: g.nbytes)
            raise BudgetError(what, budget, big.nbytes, big.name, finer=groups != "leaves")
        total = sum(g.nbytes for g in plan)
        if total <= budget:
            for g in plan:
                g.resident = True  # never offload a model that fits
        else:
            # groups that stream through the ring are measured on the first forward and
            # then kept resident by how much of their transfer cannot be hidden; groups
            # served by the narrow-weight path are never measured: fill for those in order
            room = budget - (prefetch + 1) * largest
            for g in plan:
                rides_ring = any(
                    not _narrow_layer(o, q, wants, shadowed, seam) and (not seam.host_compute or wants[id(q)][0] != wants[id(q)][1])
                    for o, _, q in g.params
                )
                if not rides_ring and g.nbytes <= room:
                    g.resident = True
                    room -= g.nbytes
            planning_budget = budget - sum(g.nbytes for g in plan if g.resident)

    file_keys: dict[int, str] = {}
    reader: SafetensorsSource | None = None
    if storage is not None:
        source = open_source(storage, what)
        if not isinstance(source, SafetensorsSource):
            source.close()
            raise ValueError(f"{what}: storage must be a safetensors checkpoint (file, *.index.json or folder), got {storage!r}")
        reader = source
        stored_entries = reader.entries()
        state_names: dict[int, list[str]] = {}
        for key, tensor in model.state_dict(keep_vars=True).items():
            state_names.setdefault(id(tensor), []).append(key)
        problems = []
        for g in plan:
            for _, pname, p in g.params:
                if (g.resident and not p.is_meta) or id(p) in file_keys:
                    continue  # a resident group reads from the file only what has no values
                found = [k for k in state_names.get(id(p), []) if k in stored_entries]
                if not found or stored_entries[found[0]].shape != tuple(p.shape):
                    problems.append(f"{g.name}.{pname}" if g.name else pname)
                else:
                    file_keys[id(p)] = found[0]
        if problems:
            reader.close()
            raise ValueError(f"{what}: {storage!r} lacks (or mis-shapes) {len(problems)} weights, e.g. {problems[:3]}")

    handle = OffloadHandle(model, seam, prefetch)
    handle._reader = reader
    handle._file_keys = file_keys
    stats = handle._stats
    try:
        _install(model, plan, wants, shadowed, handle, seam, storage_device, pin)
    except BaseException:
        record = OffloadRecord(handle)
        handle._record = record
        _undo.push(model, record)
        handle.remove()
        raise
    if any(is_patched(m, _StreamedGroup) for m in handle._patched):
        # the order streamed groups ran in, closed at the end of every forward of the model
        handle._planning_budget = planning_budget
        after = handle._plan_from_measurements if planning_budget is not None else None
        handle._hooks.append(model.register_forward_hook(_EndForward(handle._transit.order, after), always_call=True))
    stats.resident_groups = [g.name for g in plan if g.resident]
    stats.streamed_groups = [g.name for g in plan if not g.resident]
    handle._pinned = [id(p) for g in plan for _, _, p in g.params]
    for pinned_id in handle._pinned:
        _undo.pinned[pinned_id] = "an active offload"
    # a model dropped while offloaded must not leave its ids pinned (ids are reused)
    weakref.finalize(model, _unpin, list(handle._pinned))
    stats.resident_bytes = sum(g.nbytes for g in plan if g.resident)
    stats.peak_device_bytes = stats.resident_bytes
    handle._record = OffloadRecord(handle)
    _undo.push(model, handle._record)
    return handle


def _narrow_layer(
    owner: nn.Module,
    p: torch.Tensor,
    wants: dict[int, tuple[torch.dtype, torch.dtype]],
    shadowed: dict[int, torch.dtype],
    device: OffloadDevice,
) -> bool:
    """Whether ``p`` is served by the narrow-weight layer path (CPU matmul layers)."""
    stored, compute = wants[id(p)]
    narrow = shadowed.get(id(p), stored)
    return (
        _is_matmul_layer(owner)
        and device.host_compute
        and narrow != compute
        and all(shadowed.get(id(q), wants[id(q)][0]) == narrow for q in owner.parameters(recurse=False))
    )


def _install(
    model: nn.Module,
    plan: list[_Group],
    wants: dict[int, tuple[torch.dtype, torch.dtype]],
    shadowed: dict[int, torch.dtype],
    handle: OffloadHandle,
    device: OffloadDevice,
    storage_device: torch.device,
    pin: bool,
) -> None:
    """Convert storage and residency, then hook the streamed groups (undone by remove())."""
    target = device.device
    moves: list[tuple[str, torch.Tensor, torch.device, torch.dtype, bool]] = []
    done: set[int] = set()
    for group in plan:
        for _owner, pname, p in group.params:
            if id(p) in done:
                continue
            done.add(id(p))
            stored, compute = wants[id(p)]
            if group.resident:
                if id(p) in handle._file_keys:
                    # a meta parameter of a resident group: its values come from the file, once
                    assert handle._reader is not None
                    values = handle._reader.read(handle._file_keys.pop(id(p)))
                    handle._originals.append((p, p.device, p.dtype))
                    _swap_to(p, target, compute, data=values)
                    continue
                moves.append((f"{group.name}:{pname}", p, target, compute, False))
            elif id(p) not in handle._file_keys:
                moves.append((f"{group.name}:{pname}", p, storage_device, stored, pin))
    for module in model.modules():
        for bname, b in module._buffers.items():
            if b is not None and b.device != target and id(b) not in done:
                done.add(id(b))
                moves.append((bname, b, target, b.dtype, False))
    for name, tensor, to, dtype, _ in moves:
        if tensor.device != to or tensor.dtype != dtype:
            if type(tensor) in (torch.Tensor, nn.Parameter) and tensor._use_count() == 1:  # type: ignore[attr-defined]
                continue  # _swap_to copes with weak references to plain tensors
            problem = _swap_blocker(name, tensor, None, "torchsurgery.offload")
            if problem:
                raise RuntimeError(problem)
    for _, tensor, to, dtype, pin_it in moves:
        if tensor.device != to or tensor.dtype != dtype or (pin_it and not device.is_pinned(tensor)):
            handle._originals.append((tensor, tensor.device, tensor.dtype))
            _swap_to(tensor, to, dtype, pin=device if pin_it else None)

    stats = handle._stats
    packed_ids: set[int] = set()
    for group in plan:
        if group.resident:
            continue
        streamed: list[tuple[nn.Module, str, nn.Parameter, torch.dtype]] = []
        for owner, pname, p in group.params:
            stored, compute = wants[id(p)]
            if not handle._file_keys and _narrow_layer(owner, p, wants, shadowed, device):
                for q in owner.parameters(recurse=False):
                    if id(q) in shadowed:
                        handle._shadows.add(q, shadowed[id(q)])
                if not is_patched(owner, _NarrowMatmul):
                    patch(owner, _NarrowMatmul, compute, stats, handle._scratch, handle._shadows)
                    _undo.records(owner)[-1].internal = True
                    handle._patched.append(owner)
                continue
            if not device.host_compute or p.device != target or p.dtype != compute or id(p) in handle._file_keys:
                streamed.append((owner, pname, p, compute))
        if streamed:
            # pack what this group streams into one flat host buffer, the weights' only host copy
            # a weight read from the file is read by every group that uses it (a tied weight is
            # meta in between); one kept in host memory lives in the first group's buffer only
            packable = [
                e for e in streamed
                if (handle._reader is not None or id(e[2]) not in packed_ids) and type(e[2]) in (torch.Tensor, nn.Parameter)
            ]
            packed = None
            if packable and handle._reader is not None:
                # the weights stay in the file: the parameters become meta (same objects)
                params = [e[2] for e in packable]
                keys = tuple(handle._file_keys[id(q)] for q in params)
                entries = handle._reader.entries()
                layout = FlatLayout.of(params, [entries[k].dtype for k in keys])
                for param in params:
                    if not any(t is param for t, _, _ in handle._originals):
                        handle._originals.append((param, param.device, param.dtype))
                    if not param.is_meta:
                        torch.utils.swap_tensors(param, _wrap_like(param, torch.empty_like(param, device="meta")))
                    packed_ids.add(id(param))
                packed = PackedGroup(group.name, layout, None, handle._reader, keys)
                handle._transit.packed[group.name] = packed
            elif packable:
                params = [e[2] for e in packable]
                layout = FlatLayout.of(params)
                host = pack(params, layout, out=device.pinned_empty(layout.nbytes) if pin else None)
                for param, view in zip(params, unpack(host, layout), strict=True):
                    if not any(t is param for t, _, _ in handle._originals):
                        handle._originals.append((param, param.device, param.dtype))
                    param.data = view
                    packed_ids.add(id(param))
                packed = PackedGroup(group.name, layout, host)
                handle._transit.packed[group.name] = packed
            others = [e for e in streamed if not any(e is q for q in packable)]
            streamer = _GroupStreamer(group.name, packable, others, packed, handle._transit)
            patch(group.module, _StreamedGroup, streamer)
            _undo.records(group.module)[-1].internal = True
            handle._patched.append(group.module)
    handle._transit.ring = Ring(list(handle._transit.packed.values()), device, slots=handle._transit.prefetch + 1)
