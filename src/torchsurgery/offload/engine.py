"""The ``offload`` engine: weights live in storage and come in group by group.

Weights are kept in *storage* (host memory, optionally in a compact ``storage_dtype``)
and brought to ``device``/``dtype`` just before their group runs, then released. Groups
that fit in ``budget`` bytes stay resident on the device instead. On a CPU the same
engine runs with synchronous transfers; with a storage dtype narrower than the compute
dtype it is "layerwise casting" and halves the weights' memory.

Mechanics, chosen so that nothing about the model's identity changes:

* storage and residency conversions swap data into the existing parameter objects
  (``torch.utils.swap_tensors``), so optimizers and user references stay valid;
* a streamed group's root module gets a patch whose forward puts converted weights into
  its modules' ``_parameters`` for the duration of the group's forward (a differentiable
  conversion, so gradients reach the stored weights) and puts the stored parameters back
  in a ``finally``, also on ``KeyboardInterrupt`` (which skips torch's ``always_call`` hooks);
* on a CPU, ``nn.Linear`` layers stored narrower than they compute get a patch that
  reads the narrow weight directly: for a few tokens a fused, compiled kernel reduces
  straight from the narrow weight (half the memory traffic of the full-width model),
  otherwise the weight is cast once for the matmul.

Everything is recorded in the model's undo log; :meth:`OffloadHandle.remove` (or
``torchsurgery.restore``) puts every tensor back on its device in its dtype, with its
identity (values are those of the storage dtype when that was narrower).
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery.offload.grouping import find_groups
from torchsurgery.offload.order import OrderRecorder
from torchsurgery.offload.packing import FlatLayout, pack, unpack
from torchsurgery.offload.planner import GroupCost, stall_hint
from torchsurgery.offload.streams import PackedGroup, Ring
from torchsurgery.patching import Patch, is_patched, patch, unpatch
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


@dataclass
class OffloadStats:
    """What an offloaded model did so far.

    Attributes:
        bytes_moved: bytes brought to the device (or cast) for streamed groups.
        transfers: number of group materialisations.
        seconds_waiting: time the forward spent waiting for transfers and casts.
        peak_device_bytes: most weight bytes held on the device at once.
        resident_bytes: weight bytes of the resident groups.
        resident_groups: groups kept on the device.
        streamed_groups: groups brought in for each forward.
        hint: whether the last forward was transfer-bound, and what more residency would
            hide (from measured transfer and compute times, in execution order).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> handle = torchsurgery.offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, groups="leaves")
        >>> _ = model(torch.ones(1, 4))
        >>> handle.stats().streamed_groups
        ['0', '1']
        >>> _ = handle.remove()
    """

    bytes_moved: int = 0
    transfers: int = 0
    seconds_waiting: float = 0.0
    peak_device_bytes: int = 0
    resident_bytes: int = 0
    resident_groups: list[str] = field(default_factory=list)
    streamed_groups: list[str] = field(default_factory=list)
    hint: str = ""


@dataclass(eq=False)
class _Group:
    name: str
    module: nn.Module
    params: list[tuple[nn.Module, str, nn.Parameter]]
    nbytes: int
    resident: bool = False


# ---------------------------------------------------------------------- fused CPU path

_fused_kernels: dict[bool, Any] = {}
_fused_broken = False
_FUSED_MIN_WEIGHT = 1 << 18  # below this a fused kernel does not pay for itself
_FUSED_MAX_ROWS = 4


def _reduce_from_narrow(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # weight [out, in]: one pass over the narrow weight, widened in registers
    return (x.unsqueeze(-2) * weight.to(x.dtype)).sum(-1)


def _reduce_from_narrow_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # weight [in, out] (Conv1D layout): reduce over rows so reads stay contiguous
    return (x.unsqueeze(-1) * weight.to(x.dtype)).sum(-2)


def _fused_linear(x: torch.Tensor, weight: torch.Tensor, transposed: bool = False) -> torch.Tensor | None:
    global _fused_broken
    if _fused_broken:
        return None
    try:
        kernel = _fused_kernels.get(transposed)
        if kernel is None:
            kernel = _fused_kernels[transposed] = torch.compile(
                _reduce_from_narrow_t if transposed else _reduce_from_narrow, dynamic=False
            )
        result: torch.Tensor = kernel(x, weight)
        return result
    except Exception as exc:  # no compiler on this machine: fall back to casting
        _fused_broken = True
        warnings.warn(f"torchsurgery.offload: fused CPU kernel unavailable ({exc}); casting instead", stacklevel=2)
        return None


class _Scratch:
    """Reused full-width copies of narrow weights, one per shape (fresh allocations page-fault)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def widen(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(weight.shape), dtype)
        buffer = self.buffers.get(key)
        if buffer is None:
            buffer = self.buffers[key] = torch.empty(weight.shape, dtype=dtype)
        return buffer.copy_(weight)


class _Shadows:
    """Narrow copies of master parameters, refreshed when the master changes (its version)."""

    def __init__(self) -> None:
        self.entries: dict[int, list[Any]] = {}

    def add(self, param: torch.Tensor, dtype: torch.dtype) -> None:
        if id(param) not in self.entries:
            self.entries[id(param)] = [param.detach().to(dtype), param._version]

    def narrow(self, param: torch.Tensor) -> torch.Tensor:
        entry = self.entries.get(id(param))
        if entry is None:
            return param
        if entry[1] != param._version:  # an optimizer step (or any in-place write) since
            entry[0].copy_(param.detach())
            entry[1] = param._version
        copy: torch.Tensor = entry[0]
        return copy


def _is_matmul_layer(module: nn.Module) -> bool:
    """nn.Linear, or a transformers-style Conv1D (weight stored [in, out], attribute ``nf``)."""
    if isinstance(module, nn.Linear):
        return True
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and getattr(module, "nf", None) == weight.shape[1]
    )


class _NarrowMatmul(Patch, nn.Module):
    """A Linear (or Conv1D) whose stored weight is narrower than the dtype it computes in."""

    def __patch_init__(
        self, compute_dtype: torch.dtype, stats: OffloadStats, scratch: _Scratch, shadows: _Shadows
    ) -> None:
        self.__dict__["_offload_narrow"] = (compute_dtype, stats, scratch, shadows, not isinstance(self, nn.Linear))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dtype, stats, scratch, shadows, transposed = self.__dict__["_offload_narrow"]
        weight: torch.Tensor = self._parameters["weight"]  # type: ignore[assignment]
        bias: torch.Tensor | None = self._parameters.get("bias")
        x = input.to(dtype)
        stats.bytes_moved += weight.numel() * weight.element_size()
        stats.transfers += 1
        stats.peak_device_bytes = max(stats.peak_device_bytes, stats.resident_bytes + weight.numel() * dtype.itemsize)
        rows = x.numel() // max(1, x.shape[-1])
        out_features = weight.shape[1] if transposed else weight.shape[0]
        needs_grad = torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)
        x2d = x.reshape(rows, x.shape[-1])
        if not needs_grad:  # with a master copy, forwards without gradients read the narrow copy
            weight = shadows.narrow(weight)
            bias = shadows.narrow(bias) if bias is not None else None
        out: torch.Tensor | None = None
        if not needs_grad and rows <= _FUSED_MAX_ROWS and weight.numel() >= _FUSED_MIN_WEIGHT:
            out = _fused_linear(x2d, weight, transposed)
        if out is None:
            wide = weight.to(dtype) if needs_grad else scratch.widen(weight, dtype)
            out = x2d @ wide if transposed else x2d @ wide.t()
        if bias is not None:
            out = out + bias.to(dtype)
        return out.reshape(*x.shape[:-1], out_features)


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

    def __init__(self, model: nn.Module, device: torch.device, prefetch: int = 1) -> None:
        self.model = model
        self.device = device
        self._stats = OffloadStats()
        self._patched: list[nn.Module] = []
        self._originals: list[tuple[torch.Tensor, torch.device, torch.dtype]] = []
        self._transit = _Shared(prefetch)
        self._hooks: list[Any] = []
        self._scratch = _Scratch()
        self._shadows = _Shadows()
        self._pinned: list[int] = []
        self._record: OffloadRecord | None = None

    def stats(self) -> OffloadStats:
        """A snapshot of the statistics."""
        s = self._stats
        return OffloadStats(
            s.bytes_moved, s.transfers, s.seconds_waiting, s.peak_device_bytes, s.resident_bytes,
            list(s.resident_groups), list(s.streamed_groups), self._transit.hint(),
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
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module in reversed(self._patched):
            for kind in (_NarrowMatmul, _StreamedGroup):
                if is_patched(module, kind):
                    unpatch(module, kind, _internal=True)
        self._patched.clear()
        for tensor, device, dtype in reversed(self._originals):
            _swap_to(tensor, device, dtype)
        self._originals.clear()
        self._scratch.buffers.clear()
        self._transit.ring = None
        self._transit.packed.clear()
        self._shadows.entries.clear()
        _unpin(self._pinned)
        self._pinned.clear()
        _undo.remove(self.model, self._record)
        self._record = None
        return self.model

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _unpin(keys: list[int]) -> None:
    for key in keys:
        _undo.pinned.pop(key, None)


def _swap_to(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, pin: bool = False) -> None:
    data = tensor.detach().to(device=device, dtype=dtype, copy=True)
    if pin and data.device.type == "cpu":
        data = data.pin_memory()
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


def _check_dtype(value: Any, arg: str) -> torch.dtype | None:
    if value is None:
        return None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"torchsurgery.offload: {arg} must be a floating point torch.dtype, got {value!r}")
    return value


def offload(
    model: nn.Module,
    device: str | torch.device = "cpu",
    *,
    dtype: torch.dtype | None = None,
    storage_dtype: torch.dtype | None = None,
    budget: int | None = None,
    prefetch: int = 1,
    pin_memory: bool | None = None,
    groups: str | Sequence[str] = "blocks",
    skip: Callable[[nn.Module, str], bool] | None = DEFAULT_SKIP,
    master_dtype: torch.dtype | None = None,
) -> OffloadHandle:
    """Keep ``model``'s weights in storage and bring each group in just before it runs.

    Args:
        model: the model (changed in place; nothing is copied).
        device: where the computation runs.
        dtype: the compute dtype of floating weights (default: their current dtype).
        storage_dtype: the dtype weights are stored in (e.g. ``torch.bfloat16`` or
            ``torch.float8_e4m3fn``); modules selected by ``skip`` keep theirs.
        budget: device bytes the weights may take. Groups are kept resident, in
            execution order, while they fit next to the ``prefetch + 1`` largest streamed
            groups. ``None``: nothing is resident on a CPU; on a GPU, what is free minus a
            margin.
        prefetch: how many groups ahead to bring in (used by the CUDA streaming path).
        pin_memory: pin host storage; default: when ``device`` is a GPU.
        groups: ``"blocks"``, ``"leaves"`` or a list of qualified module names.
        skip: ``(module, name) -> bool``; selected modules keep their storage dtype.
        master_dtype: for training: the parameters themselves stay in this dtype (what
            the optimizer updates and gradients land in) and the engine keeps a
            ``storage_dtype`` copy for forwards without gradients, refreshed whenever a
            parameter changes. ``None``: the parameters are stored in ``storage_dtype``.

    Returns:
        An :class:`OffloadHandle` (``stats()``, ``remove()``, context manager).

    Raises:
        TypeError: an argument of the wrong kind.
        ValueError: a device that does not exist, a budget below the largest group, an
            unknown group name.
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
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{what}: {device!r} is not a device ({exc})") from exc
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{what}: device {device!r} asked for, but CUDA is not available")
        if target.index is not None and target.index >= torch.cuda.device_count():
            raise ValueError(f"{what}: {device!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    elif target.type != "cpu":
        raise ValueError(f"{what}: device must be 'cpu' or a CUDA device, got {device!r}")
    compute_dtype = _check_dtype(dtype, "dtype")
    store_dtype = _check_dtype(storage_dtype, "storage_dtype")
    master = _check_dtype(master_dtype, "master_dtype")
    if budget is not None and (not isinstance(budget, int) or budget < 0):
        raise TypeError(f"{what}: budget must be a number of bytes (int >= 0) or None, got {budget!r}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"{what}: prefetch must be an int >= 0, got {prefetch!r}")
    problem = _already_offloaded(model)
    if problem:
        raise RuntimeError(f"{what}: cannot offload the model: {problem}")
    pin = target.type == "cuda" if pin_memory is None else pin_memory
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
            if type(group_module).forward is nn.Module.forward:
                raise ValueError(
                    f"{what}: group {gname!r} is a {type(group_module).__name__}, which is never called; "
                    "name its children as groups instead"
                )
            plan.append(_Group(gname, group_module, params, nbytes))
    if not plan:
        raise ValueError(f"{what}: the model has no parameters to offload")

    # residency: in execution (model) order, while it fits next to the groups in flight
    largest = max(g.nbytes for g in plan)
    if budget is None and target.type == "cuda":
        free, _ = torch.cuda.mem_get_info(target)
        budget = max(0, int(free * 0.9) - (256 << 20))
    if budget is not None:
        if budget < largest:
            big = max(plan, key=lambda g: g.nbytes)
            raise ValueError(
                f"{what}: budget={budget} bytes cannot hold the largest group {big.name or '<root>'!r} "
                f"({big.nbytes} bytes); give at least that, or smaller groups (groups='leaves')"
            )
        total = sum(g.nbytes for g in plan)
        if total <= budget:
            for g in plan:
                g.resident = True  # never offload a model that fits
        else:
            room = budget - (prefetch + 1) * largest
            for g in plan:
                if g.nbytes <= room:
                    g.resident = True
                    room -= g.nbytes

    handle = OffloadHandle(model, target, prefetch)
    stats = handle._stats
    try:
        _install(model, plan, wants, shadowed, handle, target, storage_device, pin)
    except BaseException:
        record = OffloadRecord(handle)
        handle._record = record
        _undo.push(model, record)
        handle.remove()
        raise
    if any(is_patched(m, _StreamedGroup) for m in handle._patched):
        # the order streamed groups ran in, closed at the end of every forward of the model
        handle._hooks.append(model.register_forward_hook(_EndForward(handle._transit.order), always_call=True))
    stats.resident_groups = [g.name for g in plan if g.resident]
    stats.streamed_groups = [g.name for g in plan if not g.resident]
    handle._pinned = [id(p) for g in plan for _, _, p in g.params]
    for key in handle._pinned:
        _undo.pinned[key] = "an active offload"
    # a model dropped while offloaded must not leave its ids pinned (ids are reused)
    weakref.finalize(model, _unpin, list(handle._pinned))
    stats.resident_bytes = sum(g.nbytes for g in plan if g.resident)
    stats.peak_device_bytes = stats.resident_bytes
    handle._record = OffloadRecord(handle)
    _undo.push(model, handle._record)
    return handle


def _install(
    model: nn.Module,
    plan: list[_Group],
    wants: dict[int, tuple[torch.dtype, torch.dtype]],
    shadowed: dict[int, torch.dtype],
    handle: OffloadHandle,
    target: torch.device,
    storage_device: torch.device,
    pin: bool,
) -> None:
    """Convert storage and residency, then hook the streamed groups (undone by remove())."""
    moves: list[tuple[str, torch.Tensor, torch.device, torch.dtype, bool]] = []
    done: set[int] = set()
    for group in plan:
        for _owner, pname, p in group.params:
            if id(p) in done:
                continue
            done.add(id(p))
            stored, compute = wants[id(p)]
            if group.resident:
                moves.append((f"{group.name}:{pname}", p, target, compute, False))
            else:
                moves.append((f"{group.name}:{pname}", p, storage_device, stored, pin))
    for module in model.modules():
        for bname, b in module._buffers.items():
            if b is not None and b.device != target and id(b) not in done:
                done.add(id(b))
                moves.append((bname, b, target, b.dtype, False))
    for name, tensor, device, dtype, _ in moves:
        if tensor.device != device or tensor.dtype != dtype:
            if type(tensor) in (torch.Tensor, nn.Parameter) and tensor._use_count() == 1:  # type: ignore[attr-defined]
                continue  # _swap_to copes with weak references to plain tensors
            problem = _swap_blocker(name, tensor, None, "torchsurgery.offload")
            if problem:
                raise RuntimeError(problem)
    for _, tensor, device, dtype, pin_it in moves:
        if tensor.device != device or tensor.dtype != dtype or (pin_it and not tensor.is_pinned()):
            handle._originals.append((tensor, tensor.device, tensor.dtype))
            _swap_to(tensor, device, dtype, pin=pin_it)

    stats = handle._stats
    packed_ids: set[int] = set()
    for group in plan:
        if group.resident:
            continue
        streamed: list[tuple[nn.Module, str, nn.Parameter, torch.dtype]] = []
        for owner, pname, p in group.params:
            stored, compute = wants[id(p)]
            narrow = shadowed.get(id(p), stored)
            narrow_linear = (
                _is_matmul_layer(owner)
                and target.type == "cpu"
                and narrow != compute
                and all(shadowed.get(id(q), wants[id(q)][0]) == narrow for q in owner.parameters(recurse=False))
            )
            if narrow_linear:
                for q in owner.parameters(recurse=False):
                    if id(q) in shadowed:
                        handle._shadows.add(q, shadowed[id(q)])
                if not is_patched(owner, _NarrowMatmul):
                    patch(owner, _NarrowMatmul, compute, stats, handle._scratch, handle._shadows)
                    _undo.records(owner)[-1].internal = True
                    handle._patched.append(owner)
                continue
            if p.device != target or p.dtype != compute:
                streamed.append((owner, pname, p, compute))
        if streamed:
            # pack what this group streams into one flat host buffer, the weights' only host copy
            packable = [e for e in streamed if id(e[2]) not in packed_ids and type(e[2]) in (torch.Tensor, nn.Parameter)]
            packed = None
            if packable:
                params = [e[2] for e in packable]
                layout = FlatLayout.of(params)
                host = pack(params, layout, pin_memory=pin)
                for param, view in zip(params, unpack(host, layout), strict=True):
                    if not any(t is param for t, _, _ in handle._originals):
                        handle._originals.append((param, param.device, param.dtype))
                    param.data = view
                    packed_ids.add(id(param))
                packed = PackedGroup(group.name, layout, host)
                handle._transit.packed[group.name] = packed
            others = [e for e in streamed if not any(e is q for q in packable)]
            streamer = _GroupStreamer(group.name, packable, others, packed, target, stats, handle._transit)
            patch(group.module, _StreamedGroup, streamer)
            _undo.records(group.module)[-1].internal = True
            handle._patched.append(group.module)
    handle._transit.ring = Ring(list(handle._transit.packed.values()), target, slots=handle._transit.prefetch + 1)


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

    def __init__(self, order: OrderRecorder) -> None:
        self.order = order

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.order.end_forward()


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

    def bring_in(self) -> None:
        self.depth += 1
        if self.depth > 1:
            return  # re-entered (a shared module): already in
        start = time.perf_counter()
        shared = self.transit
        shared.order.ran(self.name)
        try:
            direct = self.other_entries
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
