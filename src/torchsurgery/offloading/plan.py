"""Planning an offload: where each weight lives, in which dtypes, before anything changes.

:func:`plan_offload` validates the arguments and decides everything :func:`~torchsurgery.offload`
will do: the groups, each parameter's storage, compute and shadow dtypes, its residency (on
the device, streamed through the ring, read from a checkpoint file, read narrow by a CPU
matmul layer, ...) and its checkpoint key. It reads the model and the checkpoint's index
but changes nothing, so a plan can be printed and checked before committing to it; the
:class:`~torchsurgery.OffloadHandle` then installs exactly that plan.

The plan's entries (:class:`ParamPlan`, :class:`GroupPlan`, :class:`Residency`) are defined in
:mod:`torchsurgery.offloading.plan_types`, and the device bytes they take, which the budget is
checked against, are counted in :mod:`torchsurgery.offloading.budgets`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._checkpoint import SafetensorsSource, open_source, scaled_keys
from torchsurgery._device import OffloadDevice, resolve_device
from torchsurgery._format import human_bytes
from torchsurgery._validate import (
    STORAGE_DTYPES,
    check_bytes,
    check_dtype,
    check_storage_dtype,
    dtype_name,
    holds_exactly,
)
from torchsurgery.compact import (
    Scaled,
    foreign_subclass,
    is_matmul_layer,
    plain_reader,
    reads_elsewhere_only,
    stored_values,
)
from torchsurgery.errors import ArgumentTypeError, ArgumentValueError, BudgetError, Setting
from torchsurgery.offloading.budgets import (
    buffer_bytes,
    check_budget,
    device_bytes,
    held_by,
    held_bytes,
    least_refused,
)
from torchsurgery.offloading.grouping import find_groups
from torchsurgery.offloading.host_fit import Placed, fit_to_host
from torchsurgery.offloading.host_tier import HostAccount, assign_tiers
from torchsurgery.offloading.plan_types import GroupPlan, ParamPlan, PlanOptions, Residency

__all__ = [
    "plan_offload", "OffloadPlan", "GroupPlan", "ParamPlan", "Residency", "DEFAULT_SKIP", "device_bytes",
]

_WHAT = "torchsurgery.offload"


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
class OffloadPlan:
    """What :func:`~torchsurgery.offload` will do to a model; ``str()`` gives a table.

    Attributes:
        device: where the computation runs.
        groups: the groups, in model order.
        budget: device bytes the weights may take (``None``: no limit).
        measured_budget: the part of the budget left for groups the first forward's
            measurements make resident (the first forward without gradients; ``None``: no
            planning after a forward).
        prefetch: groups brought in ahead.
        pin_memory: whether streamed host buffers are page-locked.
        storage: the checkpoint streamed groups are read from, if any.
        host_budget: host bytes the groups read from ``storage`` may keep in memory (the
            host tier; ``None`` without a checkpoint).
        offload_device: the device seam the offload runs through.
        buffer_bytes: device bytes of the model's buffers, which the offload moves to the
            device (0 on a CPU: they stay where they are).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> print(torchsurgery.plan_offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32))
        offload to cpu: 2 groups (0 resident), 72 B of weights as stored; budget none, prefetch 1, host memory not pinned
        group  parameter  residency  storage   compute  shadow  file key
        0      0.weight   narrow     bfloat16  float32  -       -
        0      0.bias     narrow     bfloat16  float32  -       -
        1      1.weight   in place   float32   float32  -       -
        1      1.bias     in place   float32   float32  -       -
    """

    device: torch.device
    groups: list[GroupPlan]
    budget: int | None
    measured_budget: int | None
    prefetch: int
    pin_memory: bool
    storage: str | os.PathLike[str] | None
    offload_device: OffloadDevice = field(repr=False, compare=False)
    buffer_bytes: int = 0
    host_budget: int | None = None

    @property
    def params(self) -> list[ParamPlan]:
        """Every parameter entry of every group."""
        return [p for g in self.groups for p in g.params]

    def device_bytes(self, resident: Collection[str]) -> int:
        """Device bytes the offload holds at once with the groups named in ``resident`` kept
        resident and the others streamed (see :func:`~torchsurgery.offloading.budgets.device_bytes`)."""
        return device_bytes(self.groups, resident, self.prefetch, self.offload_device.allocation_granule, self.buffer_bytes)

    def __str__(self) -> str:
        resident = sum(g.resident for g in self.groups)
        total = sum(g.nbytes for g in self.groups)
        budget = "none" if self.budget is None else human_bytes(self.budget, binary=True)
        head = (
            f"offload to {self.device}: {len(self.groups)} groups ({resident} resident), "
            f"{human_bytes(total, binary=True)} of weights as stored; budget {budget}, "
            f"prefetch {self.prefetch}, host memory {'pinned' if self.pin_memory else 'not pinned'}"
        )
        rows: list[tuple[str, ...]] = [("group", "parameter", "residency", "storage", "compute", "shadow", "file key")]
        for g in self.groups:
            for p in g.params:
                shadow = dtype_name(p.shadow_dtype) if p.shadow_dtype is not None else "-"
                residency = p.residency.value + (f" (= {p.tied_to})" if p.tied_to else "")
                rows.append((g.name or "<root>", p.name, residency, dtype_name(p.storage_dtype),
                             dtype_name(p.compute_dtype), shadow, p.file_key or "-"))
        if self.storage is not None:  # streamed from a file: which tier each group sits in
            head += f"; host budget {human_bytes(self.host_budget or 0, binary=True)}"
            tiers = [g.tier for g in self.groups for _ in g.params]
            rows = [(*rows[0][:1], "tier", *rows[0][1:])] + [(r[0], t, *r[1:]) for r, t in zip(rows[1:], tiers, strict=True)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        return "\n".join([head, *lines])


def already_offloaded(model: nn.Module) -> str | None:
    """Why ``model`` cannot be offloaded again (an offload of ours or a peer's hooks), if so."""
    for name, module in model.named_modules():
        if any(r.kind == "offload" for r in _undo.records(module)):
            return f"it is already offloaded by torchsurgery ({name or '<root>'}); remove() that first"
        if hasattr(module, "_hf_hook"):
            return f"{name or '<root>'} carries an accelerate hook (cpu_offload/dispatch_model); remove it first"
        if getattr(module, "_diffusers_hook", None) is not None:
            return f"{name or '<root>'} carries a diffusers hook (group offloading/layerwise casting); remove it first"
    # a part of a model offloaded whole: the offload is on the model, its hold on every weight
    holder = _undo.holder_of_any(model.parameters())
    if holder is not None:
        return (
            f"its weights are held by {holder} of a model it is part of; remove() that offload first, or "
            "choose this module's treatment through that offload's groups, skip and budget"
        )
    return None


def check_storage_format(value: object, what: str) -> torch.dtype | Scaled | None:
    """``value`` if weights can be stored in it: a :class:`~torchsurgery.compact.Scaled` format, or a dtype
    :func:`~torchsurgery._validate.check_storage_dtype` takes (its ``TypeError`` otherwise)."""
    return value if isinstance(value, Scaled) else check_storage_dtype(value, what)


def _check_options(
    model: nn.Module,
    device: str | torch.device | OffloadDevice,
    dtype: torch.dtype | None,
    storage_dtype: torch.dtype | Scaled | None,
    master_dtype: torch.dtype | None,
    budget: int | None,
    prefetch: int,
    pin_memory: bool | None,
    skip: Callable[[nn.Module, str], bool] | None,
    groups: object,
    storage: object,
    offloaded_ok: bool = False,
) -> PlanOptions:
    """Every argument checked, in the order a user would fix them."""
    _undo.check_not_compiling("offload")
    _undo.check_module(model, _WHAT)
    _undo.check_idle(model, _WHAT)
    seam = resolve_device(device, _WHAT)
    compute = check_dtype(dtype, _WHAT, "dtype")
    stored = check_storage_format(storage_dtype, _WHAT)
    master = check_storage_dtype(master_dtype, _WHAT, "master_dtype")
    if isinstance(stored, Scaled) and master is not None:
        raise ArgumentValueError(
            _WHAT, "master_dtype", master, f"does not apply with storage_dtype={stored!r}: a master weight's narrow "
            "copy is refreshed by a plain cast after every write, and a scaled copy would have to choose its scale "
            "again at each optimizer step (a grid that moves under training); that is not built",
            "leave out master_dtype (writes to a scaled weight round to its grid, its scale kept), or give a plain "
            "storage_dtype",
        )
    if master is not None and storage is not None:
        # weights read from a checkpoint file serve inference only: nothing trains a master
        raise ArgumentValueError(
            _WHAT, "master_dtype", master,
            f"does not apply with storage={storage!r}: weights streamed from a checkpoint serve inference only",
            "leave out master_dtype (storage_dtype sets the format the weights are kept in)",
        )
    check_bytes(budget, _WHAT, "budget")
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ArgumentValueError(_WHAT, "prefetch", prefetch, f"must be an int >= 0, got {prefetch!r}")
    if skip is not None and not callable(skip):
        raise ArgumentTypeError(_WHAT, "skip", skip, f"must be a filter (module, name) -> bool or None, got {skip!r}")
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise ArgumentTypeError(
            _WHAT, "pin_memory", pin_memory, f"must be True, False or None (automatic), got {pin_memory!r}"
        )
    problem = None if offloaded_ok else already_offloaded(model)
    if problem:
        raise RuntimeError(f"{_WHAT}: cannot offload the model: {problem}")
    if pin_memory and not seam.can_pin:
        raise ArgumentValueError(
            _WHAT, "pin_memory", pin_memory,
            f"is True, but host memory cannot be pinned for {str(seam.device)!r} (page-locked memory needs an accelerator)",
            "pass {}", Setting("pin_memory", False),
        )
    pin = (not seam.host_compute and seam.can_pin) if pin_memory is None else pin_memory
    return PlanOptions(seam, compute, stored, master, budget, prefetch, pin, skip, groups != "leaves")


def _members(named: dict[str, nn.Module], names: list[str]) -> dict[str, list[str]]:
    """Each group's modules: a module belongs to the innermost group containing it."""
    members: dict[str, list[str]] = {g: [] for g in names}
    for qual in named:
        parts = qual.split(".") if qual else []
        enclosing = (".".join(parts[:i]) for i in range(len(parts), -1, -1))  # itself, then outwards
        group = next((g for g in enclosing if g in members), None)
        if group is not None:
            members[group].append(qual)
    return members


def _collect(
    named: dict[str, nn.Module],
    names: list[str],
    dtype: torch.dtype | None,
    storage_dtype: torch.dtype | Scaled | None,
    master_dtype: torch.dtype | None,
    skip: Callable[[nn.Module, str], bool] | None,
    converted: Mapping[int, torch.dtype] | None = None,
) -> list[GroupPlan]:
    """The groups with their parameters' dtypes and held bytes (residency filled in later).

    ``converted`` maps parameters (by ``id``) the user converted with ``.to()`` while offloaded
    to the dtype they were converted to: they compute in it, whatever ``dtype`` says, and
    keep ``storage_dtype`` only where it holds their values exactly (narrower than theirs).
    A :class:`~torchsurgery.compact.scaled.Scaled` format applies to weights of two or more
    dimensions; the others (biases) are kept in the compute dtype.
    """
    # a weight keeps its dtype when any module holding it is skipped (e.g. tied to an embedding)
    kept = {id(p) for q, m in named.items() if skip is not None and skip(m, q) for p in m.parameters(recurse=False)}
    first: dict[int, str] = {}  # parameter -> its first qualified name, while planning only
    plan: list[GroupPlan] = []
    for gname, quals in _members(named, names).items():
        group = GroupPlan(gname, resident=False, nbytes=0)
        for qual in quals:
            for attr, p in named[qual]._parameters.items():
                if p is None:
                    continue
                # a weight of another library's tensor subclass (torchao's quantised weights) is kept as it is
                floating = p.is_floating_point() and not foreign_subclass(p)
                # a weight the user converted is planned as it will be once converted (a check before
                # the conversion plans it in its old dtype): kept in its new dtype where no other is asked
                own = converted.get(id(p), p.dtype) if converted is not None else p.dtype
                compute = dtype if (dtype is not None and floating) else own
                narrow = storage_dtype if (storage_dtype is not None and floating and id(p) not in kept) else compute
                scaled = narrow if isinstance(narrow, Scaled) and p.dim() >= 2 and id(p) not in (converted or {}) else None
                if isinstance(narrow, Scaled):
                    stored = narrow.dtype if scaled is not None else compute
                else:
                    stored = narrow
                if converted is not None and id(p) in converted:
                    compute = converted[id(p)]
                    stored = stored if stored.itemsize < compute.itemsize else compute
                name = f"{qual}.{attr}" if qual else attr
                shadow = None
                if stored != compute and master_dtype is not None:
                    _check_master_holds(master_dtype, name, stored_values(p).dtype)  # the values as kept
                    shadow, stored = stored, master_dtype  # the parameter keeps the master dtype
                tied = first.setdefault(id(p), name)
                entry = ParamPlan(name, qual, attr, stored, compute, shadow, Residency.STREAMED, None,
                                  tied if tied != name else None, p.numel() * compute.itemsize, scaled,
                                  scale_nbytes=0 if scaled is None else scaled.scale_nbytes(p.shape))
                group.params.append(entry)
                if tied == name:
                    group.nbytes += held_bytes(entry)
        if group.params:
            plan.append(group)
    return plan


def _check_master_holds(master: torch.dtype, name: str, dtype: torch.dtype) -> None:
    """Refuse a master dtype that would round the values it keeps (``remove()`` gives them back)."""
    if not holds_exactly(master, dtype):
        choices = ", ".join(str(d) for d in STORAGE_DTYPES if holds_exactly(d, dtype))
        raise ArgumentTypeError(
            _WHAT, "master_dtype", master,
            f"must hold the values of the weights it keeps exactly, but {master} cannot hold those of {name!r} "
            f"({dtype}); give one that can ({choices}), or leave master_dtype out",
        )


def sizes(
    model: nn.Module,
    what: str,
    *,
    dtype: torch.dtype | None,
    storage_dtype: torch.dtype | Scaled | None,
    groups: str | Sequence[str],
    skip: Callable[[nn.Module, str], bool] | None,
    converted: Mapping[int, torch.dtype] | None = None,
    device: OffloadDevice | None = None,
    prefetch: int = 1,
    least: bool = False,
) -> tuple[int, int, int]:
    """Device bytes ``model`` takes kept whole, its largest group's as held, and what it holds at
    the least streamed (every group in the ring at ``prefetch``), as an offload to ``device``
    counts them against its budget (:func:`device_bytes`: allocations rounded as the device
    rounds them, buffers moved there; default: plain bytes, no buffers). The dtypes are checked
    by the caller. ``least``: in the finest plan a budget that is not the user's falls back to
    (:func:`_fitted`): single modules, one at a time.
    """
    named = dict(model.named_modules())
    groups, prefetch = ("leaves", 0) if least else (groups, prefetch)
    plan = _collect(named, find_groups(model, groups, what), dtype, storage_dtype, None, skip, converted)
    granule = device.allocation_granule if device is not None else 1
    buffers = buffer_bytes(model, device) if device is not None else 0
    if device is not None:  # each weight as it would stream, as the offload's budget check takes them
        _route(named, plan, PlanOptions(device, dtype, storage_dtype, None, None, prefetch, False, skip, False), from_file=False)
    whole = device_bytes(plan, {g.name for g in plan}, prefetch, granule, buffers)
    if not plan:
        return whole, 0, whole
    largest = max(held_by(g, granule) for g in plan)
    streaming = min(whole, max(largest, device_bytes(plan, set(), prefetch, granule, buffers)))
    return whole, max(g.nbytes for g in plan), streaming


def _reads_narrow(named: dict[str, nn.Module], group: GroupPlan, p: ParamPlan, options: PlanOptions) -> bool:
    """Whether ``p`` is served by the narrow-weight layer path (CPU matmul layers)."""
    narrow = p.shadow_dtype or p.storage_dtype
    if not options.device.host_compute or narrow == p.compute_dtype or not is_matmul_layer(named[p.module]):
        return False
    if p.scaled is not None:  # its layer's bias stays in the compute dtype: the product adds it
        return all(q is p or q.storage_dtype == q.compute_dtype for q in group.params if q.module == p.module)
    return all((q.shadow_dtype or q.storage_dtype) == narrow for q in group.params if q.module == p.module)


def _file_reads_narrow(named: dict[str, nn.Module], groups: list[GroupPlan], options: PlanOptions) -> None:
    """With a ``storage_dtype``, the weights read from the file that a CPU's matmul layer reads narrow
    (``ParamPlan.reads_narrow``), as it reads those an offload from memory keeps narrow (a tied
    weight as its first occurrence: one tensor, read narrow wherever it computes)."""
    first: dict[str, bool] = {}
    for g in groups:
        for p in g.params:
            file = p.residency is Residency.FILE and options.storage_dtype is not None
            p.reads_narrow = file and (first[p.tied_to] if p.tied_to in first else _reads_narrow(named, g, p, options))
            first.setdefault(p.name, p.reads_narrow)


def _route(named: dict[str, nn.Module], groups: list[GroupPlan], options: PlanOptions, from_file: bool) -> None:
    """Each parameter's residency, the group's residency and tied weights given."""
    where: dict[str, tuple[Residency, str]] = {}  # first name -> (its residency, its group)
    for group in groups:
        for p in group.params:
            first = where.get(p.tied_to) if p.tied_to else None
            host = options.device.host_compute
            # an installer's weight reading as another device is taken as its host values (the
            # engine swaps them in before it moves anything), and a weight of the active offload
            # being planned again (a conversion) as the plain tensor its removal gives back
            t = p.lookup_in(named)
            plain = type(t) in (torch.Tensor, nn.Parameter) or reads_elsewhere_only(t) or _undo.holder_of_any([t]) is not None
            if group.resident or (first is not None and first[0] is Residency.RESIDENT):
                p.residency = Residency.RESIDENT  # in its storage dtype, as when it streams
                if not plain:  # a tensor subclass is not wrapped to read as it computes: kept as it computes
                    p.storage_dtype, p.shadow_dtype, p.scaled, p.scale_nbytes = p.compute_dtype, None, None, 0
            elif from_file:
                p.residency = Residency.FILE
            elif _reads_narrow(named, group, p, options):
                p.residency = Residency.NARROW
            elif host and p.storage_dtype == p.compute_dtype:
                p.residency = Residency.IN_PLACE
            elif first is not None and first[1] != group.name:
                p.residency = Residency.CONVERTED  # its host copy is in the first group's buffer
            elif not plain:
                p.residency = Residency.CONVERTED  # a tensor subclass is not packed into bytes
            else:
                p.residency = Residency.STREAMED
            if p.tied_to is None:
                where[p.name] = (p.residency, group.name)


def _check_scaled_plain(named: dict[str, nn.Module], groups: list[GroupPlan]) -> None:
    """Refuse a scaled format for a weight that is a tensor subclass converted at each run: its values
    cannot be quantised into a plain ``q`` and scale (those kept resident keep their own dtype)."""
    for g in groups:
        for p in g.params:
            if p.scaled is not None and p.residency is Residency.CONVERTED and p.tied_to is None:
                kind = type(p.lookup_in(named)).__name__
                raise ArgumentValueError(
                    _WHAT, "storage_dtype", p.scaled,
                    f"keeps plain weights only, but {p.name!r} is a {kind} (a tensor subclass, converted at each run): "
                    "its values cannot be kept as narrow values and a scale",
                    f"leave {p.module or '<root>'!r} out (skip=...), or give a plain storage_dtype such as torch.bfloat16",
                )


def _check_plain_readers(named: dict[str, nn.Module], groups: list[GroupPlan]) -> None:
    """Refuse to keep narrow the weights of a module whose patch reads weight memory directly."""
    wrapped = {id(p.lookup_in(named)): p.name for g in groups for p in g.params if p.reads_as_computed()}
    for qual, module in named.items():
        reader = plain_reader(module)
        found = next((wrapped[id(t)] for t in module.parameters() if id(t) in wrapped), None) if reader else None
        if reader is not None and found is not None:
            raise TypeError(
                f"{_WHAT}: {qual or '<root>'} carries the patch {reader.__qualname__}, which reads weight memory "
                f"directly (__patch_needs_plain_weights__), so {found!r} cannot be kept in another dtype than it "
                "computes in; leave the module out (skip=...), offload without storage_dtype, or unpatch it first"
            )


def _check_values(named: dict[str, nn.Module], groups: list[GroupPlan]) -> None:
    """Refuse weights without values (on the meta device) when there is no checkpoint to read them
    from, and weights a scaled format cannot keep: an inf or NaN makes its channel's scale (or, per
    tensor, the weight's) inf or NaN, and every value it scales NaN."""
    empty = [p.name for g in groups for p in g.params if p.lookup_in(named).is_meta]
    if empty:
        raise ValueError(
            f"{_WHAT}: {len(empty)} weights are on the meta device (no values), e.g. {empty[:3]}; "
            "stream them from their checkpoint with storage='model.safetensors', or load them first"
        )
    for p in (p for g in groups for p in g.params if p.scaled is not None and p.tied_to is None):
        values = p.lookup_in(named).detach()
        bad = int(values.numel() - torch.isfinite(values).sum())
        if bad:
            raise ArgumentValueError(
                _WHAT, "storage_dtype", p.scaled,
                f"{p.scaled} cannot keep {p.name!r}: {bad} of its values are inf or NaN, which would make the scale of "
                "its channel (or, per tensor, of the whole weight) inf or NaN and every value it scales NaN",
                f"leave the module out (skip=lambda module, name: name == {p.module!r}), keep the model in a plain "
                "storage_dtype such as torch.bfloat16 (which keeps inf as inf), or replace those values first",
            )


def _warn(sentence: str) -> None:
    """Say which finer groups an offload without a budget of the user's took (one warning)."""
    warnings.warn(f"{_WHAT}: {sentence}", UserWarning, stacklevel=6)


def _quiet(sentence: str) -> None:
    """Say nothing (a plan made only to check another)."""


def _finer(options: PlanOptions) -> list[tuple[str, PlanOptions]]:
    """The finer plans to try, coarsest first, down to single weights: each module that holds
    weights alone (a layer's weight and bias), then one of them in the ring at a time."""
    leaves = dataclasses.replace(options, finer_groups=False)
    steps = [("single modules (groups='leaves')", leaves)] if options.finer_groups else []
    if options.prefetch:
        steps.append(("single modules one at a time (groups='leaves', prefetch=0)", dataclasses.replace(leaves, prefetch=0)))
    return steps


def _fitted(
    model: nn.Module, named: dict[str, nn.Module], groups: list[GroupPlan], converted: Mapping[int, torch.dtype] | None,
    options: PlanOptions, buffers: int, report: Callable[[str], None] | None,
) -> tuple[list[GroupPlan], PlanOptions, int | None, int | None]:
    """The groups with their residency chosen within the budget: as chosen, or (with ``report``:
    the budget is not the user's) the first finer plan that fits (:func:`_finer`), reported in one
    sentence. Refused (:class:`BudgetError`) only where the finest cannot fit: its largest single weight."""
    try:
        return groups, options, *_choose_residency(named, groups, options, buffers)
    except BudgetError as error:
        if report is None:
            raise
        refused = last = error
    for step, finer in _finer(options):
        groups = _collect(named, find_groups(model, "leaves", _WHAT), options.dtype, options.storage_dtype,
                          options.master_dtype, options.skip, converted)
        try:
            budget, measured = _choose_residency(named, groups, finer, buffers)
        except BudgetError as error:
            last = error
            continue
        report(
            f"its groups need {human_bytes(refused.needed, binary=True)} on {options.device.device} at "
            f"prefetch={options.prefetch}, more than the {human_bytes(refused.budget, binary=True)} it may take "
            f"there; streaming {step} instead"
        )
        return groups, finer, budget, measured
    raise least_refused(groups, last, options, buffers)


def _choose_residency(
    named: dict[str, nn.Module], groups: list[GroupPlan], options: PlanOptions, buffers: int
) -> tuple[int | None, int | None]:
    """Mark the groups resident from the start; returns (budget, budget left for measured residency)."""
    seam, budget = options.device, options.budget
    if budget is None and not seam.host_compute:
        budget = max(0, int(seam.free_memory() * 0.9) - (256 << 20))
    if budget is None:
        return None, None
    # every group as it would stream: what the budget is counted against
    _route(named, groups, options, from_file=False)
    check_budget(budget, groups, options, buffers)
    every = {g.name for g in groups}
    if device_bytes(groups, every, options.prefetch, seam.allocation_granule, buffers) <= budget:
        for g in groups:
            g.resident = True  # never offload a model that fits
        return budget, None
    # groups that stream through the ring from memory are measured on the first forward and
    # then kept resident by how much of their transfer cannot be hidden; the others (served
    # by the narrow-weight path, or needing no conversion) are filled in order, also when
    # their weights are then read from a checkpoint file
    resident: set[str] = set()
    for g in groups:
        rides_ring = any(p.residency not in (Residency.NARROW, Residency.IN_PLACE) for p in g.params)
        if not rides_ring and device_bytes(groups, resident | {g.name}, options.prefetch, seam.allocation_granule, buffers) <= budget:
            g.resident = True
            resident.add(g.name)
    return budget, budget - sum(g.nbytes for g in groups if g.resident)


def _keep_file_format(p: ParamPlan, file_dtype: torch.dtype, narrowing: bool) -> None:
    """Keep ``p`` (its values read from the checkpoint file) in the file's format unless a
    ``storage_dtype`` was given (``narrowing``) and its planned format would change its values:
    a plain dtype that cannot hold every value of the file's, or a scaled one narrower than the
    file's dtype. A weight the file stores scaled (ComfyUI's layout) keeps its format. Where the
    file's format is kept, the values are those the planned one would keep, in as few bytes or
    fewer; elsewhere the weight is converted from the file's values as they are read."""
    narrows = narrowing and file_dtype.is_floating_point and p.compute_dtype.is_floating_point and p.file_scale is None
    if narrows and p.scaled is not None:
        narrows = p.scaled.dtype.itemsize < file_dtype.itemsize
    elif narrows:
        narrows = not holds_exactly(p.storage_dtype, file_dtype)
    if not narrows:
        p.storage_dtype, p.scaled, p.scale_nbytes = file_dtype, None, 0
    p.converts, p.file_dtype = narrows, file_dtype


def _file_keys(
    model: nn.Module, named: dict[str, nn.Module], groups: list[GroupPlan], storage: str | os.PathLike[str],
    options: PlanOptions,
) -> None:
    """Find each parameter read from the checkpoint under one of its ``state_dict`` names, and the
    format it is kept in (:func:`_keep_file_format`) and read narrow in (:func:`_file_reads_narrow`)."""
    source = open_source(storage, _WHAT)
    try:
        if not isinstance(source, SafetensorsSource):
            raise ValueError(f"{_WHAT}: storage must be a safetensors checkpoint (file, *.index.json or folder), got {storage!r}")
        stored = source.entries()
    finally:
        source.close()
    state_names: dict[int, list[str]] = {}
    state = model.state_dict(keep_vars=True)
    for key, tensor in state.items():
        state_names.setdefault(id(tensor), []).append(key)
    scaled = scaled_keys(stored, state.keys())  # ComfyUI's scaled fp8 weights: read narrow, computed as q * scale
    if scaled.problems:
        raise ValueError(f"{_WHAT}: {storage!r} holds scales that cannot be read:\n  " + "\n  ".join(scaled.problems))
    problems = []
    for p in (p for g in groups for p in g.params):
        tensor = p.lookup_in(named)
        if p.residency is Residency.RESIDENT and not tensor.is_meta:
            continue  # a resident group reads from the file only what has no values
        found = [k for k in state_names.get(id(tensor), []) if k in stored]
        if not found or stored[found[0]].shape != tuple(tensor.shape):
            problems.append(p.name)
        else:
            p.file_key = found[0]
            p.file_scale = scaled.scales.get(found[0])
            if p.residency is Residency.FILE:
                _keep_file_format(p, stored[found[0]].dtype, options.storage_dtype is not None)
    if problems:
        raise ValueError(f"{_WHAT}: {storage!r} lacks (or mis-shapes) {len(problems)} weights, e.g. {problems[:3]}")
    _file_reads_narrow(named, groups, options)


def plan_offload(
    model: nn.Module, device: str | torch.device | OffloadDevice = "cpu", *, dtype: torch.dtype | None = None,
    storage_dtype: torch.dtype | Scaled | None = None, budget: int | str | None = None, prefetch: int = 1,
    pin_memory: bool | None = None, groups: str | Sequence[str] = "blocks",
    skip: Callable[[nn.Module, str], bool] | None = DEFAULT_SKIP, master_dtype: torch.dtype | None = None,
    storage: str | os.PathLike[str] | None = None, host_budget: int | None = None,
) -> OffloadPlan:
    """What :func:`~torchsurgery.offload` with these arguments would do, without doing it.

    Checks the arguments as :func:`~torchsurgery.offload` does; the model is left
    untouched (a checkpoint is only indexed, a device only asked for its free memory).

    Args:
        model: the model to plan for.
        device: where the computation would run.
        dtype: compute dtype of floating weights (default: theirs).
        storage_dtype: the dtype weights would be stored in, resident or streamed (``skip``
            keeps theirs).
        budget: device bytes the weights may take.
        prefetch: groups brought in ahead.
        pin_memory: pin host storage (default: on an accelerator that can).
        groups: ``"blocks"``, ``"leaves"`` or a list of qualified module names.
        skip: ``(module, name) -> bool``; selected modules keep their own dtype.
        master_dtype: the dtype parameters keep for training, next to a narrow copy; it
            must hold their values exactly.
        storage: a safetensors checkpoint to stream weights from (in its dtypes, or a narrower
            ``storage_dtype`` they are converted to as they are read; see :func:`~torchsurgery.offload`).
        host_budget: host bytes of weights from ``storage`` kept in memory (``GroupPlan.tier``; as for ``offload``).

    Returns:
        An :class:`OffloadPlan`: per group and per parameter the storage, compute and
        shadow dtypes, the residency and the checkpoint key; ``print()`` it for a table.

    Raises:
        TypeError: an argument of the wrong kind; a storage or master dtype weights cannot
            be kept in (exactly, for the master); or a module to keep in another dtype
            carries a patch that reads weight memory directly (``__patch_needs_plain_weights__``).
        ValueError: a device that does not exist, ``pin_memory=True`` where host memory
            cannot be pinned, a budget below the largest group, an unknown group name,
            weights without values and no checkpoint, a checkpoint lacking weights, a
            ``master_dtype`` with a checkpoint, read buffers beyond the host's memory with a ``host_budget``.
        RuntimeError: already offloaded (by torchsurgery, accelerate or diffusers); a weight too large for the host.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> plan = torchsurgery.plan_offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, groups="leaves")
        >>> [(p.name, p.residency.value, p.storage_dtype) for p in plan.params]  # doctest: +NORMALIZE_WHITESPACE
        [('0.weight', 'narrow', torch.bfloat16), ('0.bias', 'narrow', torch.bfloat16),
         ('1.weight', 'in place', torch.float32), ('1.bias', 'in place', torch.float32)]
        >>> model[0].weight.dtype  # nothing changed yet
        torch.float32
    """
    return plan_converted(
        model, device, None, dtype=dtype, storage_dtype=storage_dtype, budget=budget, prefetch=prefetch,
        pin_memory=pin_memory, groups=groups, skip=skip, master_dtype=master_dtype, storage=storage, host_budget=host_budget,
    )


def plan_converted(
    model: nn.Module,
    device: str | torch.device | OffloadDevice,
    converted: Mapping[int, torch.dtype] | None,
    *,
    dtype: torch.dtype | None,
    storage_dtype: torch.dtype | Scaled | None,
    budget: int | str | None,
    prefetch: int,
    pin_memory: bool | None,
    groups: str | Sequence[str],
    skip: Callable[[nn.Module, str], bool] | None,
    master_dtype: torch.dtype | None,
    storage: str | os.PathLike[str] | None,
    offloaded_ok: bool = False,
    fallback: Callable[[str], None] | None = None,
    host_budget: int | HostAccount | None = None,
    host_fallback: Callable[[str], None] | None = None,
) -> OffloadPlan:
    """:func:`plan_offload`, with the parameters the user converted while offloaded (see :func:`_collect`).

    ``offloaded_ok``: plan a model that is offloaded now (to check, before its offload is
    removed, that the converted model can be offloaded again). ``fallback``: given where ``budget`` is not the user's (a pool's grant out of the free
    memory): when the groups do not fit in it, finer ones are planned (:func:`_fitted`) and
    ``fallback`` is called with one sentence naming the choice. With no ``budget`` on an
    accelerator (the budget then comes from its free memory) the same, with a warning. ``host_budget`` may be a
    :class:`~torchsurgery.offloading.host_tier.HostAccount` (a pool's): the part of it free now. ``host_fallback``:
    given where the host budget is not the user's (a pool's made from the memory available): when the
    host cannot hold the buffers of the groups streamed from ``storage``, finer ones are planned
    (:func:`~torchsurgery.offloading.host_fit.fit_to_host`) and it is told the choice; with no
    ``host_budget``, the same, with a warning.
    ``budget="least"``: every group streamed, at the least the (converted) model takes."""
    if budget == "least":
        keywords = {"dtype": dtype, "storage_dtype": storage_dtype, "prefetch": prefetch, "pin_memory": pin_memory,
                    "groups": groups, "skip": skip, "master_dtype": master_dtype, "storage": storage,
                    "offloaded_ok": offloaded_ok, "host_budget": host_budget}
        budget = _least_budget(model, device, converted, keywords)
    options = _check_options(model, device, dtype, storage_dtype, master_dtype, check_bytes(budget, _WHAT, "budget"),
                             prefetch, pin_memory, skip, groups, storage, offloaded_ok)
    named = dict(model.named_modules())
    plan = _collect(
        named, find_groups(model, groups, _WHAT), options.dtype, options.storage_dtype, options.master_dtype,
        options.skip, converted,
    )
    if not plan:
        raise ValueError(f"{_WHAT}: the model has no parameters to offload")
    if storage is None:
        _check_values(named, plan)
    buffers = buffer_bytes(model, options.device)
    tell = (fallback, host_fallback, offloaded_ok)
    placed, host = _fit(model, named, plan, converted, options, buffers, storage, budget is None, host_budget, tell)
    plan, options, budget, measured = placed
    assign_tiers(plan, host if storage is not None else host_budget, storage is not None)
    seam = options.device
    return OffloadPlan(seam.device, plan, budget, measured, options.prefetch, options.pin, storage, seam, buffers, host)


def _fit(
    model: nn.Module, named: dict[str, nn.Module], plan: list[GroupPlan], converted: Mapping[int, torch.dtype] | None,
    options: PlanOptions, buffers: int, storage: str | os.PathLike[str] | None, no_budget: bool,
    host_budget: int | HostAccount | None, tell: tuple[Callable[[str], None] | None, Callable[[str], None] | None, bool],
) -> tuple[Placed, int | None]:
    """The plan placed on the device and, streamed from ``storage``, fitted to the host (the host tier's
    budget second); ``tell``: who hears of a fallback on the device and on the host (:func:`plan_converted`'s
    ``fallback`` and ``host_fallback``), and whether the plan only checks another (then nobody)."""
    fallback, host_fallback, offloaded_ok = tell
    if fallback is None and no_budget and not options.device.host_compute:
        fallback = _warn  # the budget comes from the device's free memory: never refuse what can run
    if host_fallback is None and host_budget is None:
        host_fallback = _warn  # the host budget comes from the memory available: the same
    fallback, host_fallback = ((_quiet if f is not None and offloaded_ok else f) for f in (fallback, host_fallback))
    heard: list[str] = []  # the device's choice, told once the host's is known (one sentence for both)
    placed = _placed(model, named, plan, converted, options, buffers, None if fallback is None else heard.append, storage)
    host: int | None = None
    if storage is not None:
        host_heard: list[str] = []
        placed, host = fit_to_host(placed, _finer_placed(model, named, converted, placed[1], buffers, storage),
                                   host_budget, None if host_fallback is None else host_heard.append)
        if host_heard:  # the host's choice is the last word: it names what streams
            heard, fallback = host_heard, host_fallback
    if heard and fallback is not None:
        fallback(heard[-1])
    return placed, host


def _placed(
    model: nn.Module, named: dict[str, nn.Module], groups: list[GroupPlan], converted: Mapping[int, torch.dtype] | None,
    options: PlanOptions, buffers: int, report: Callable[[str], None] | None, storage: str | os.PathLike[str] | None,
) -> Placed:
    """The groups fitted to the device (:func:`_fitted`; ``report`` as there), each weight routed and
    checked, and found in ``storage`` (in the file's dtypes) where the weights stream from it."""
    groups, options, budget, measured = _fitted(model, named, groups, converted, options, buffers, report)
    _route(named, groups, options, storage is not None)
    _check_scaled_plain(named, groups)
    _check_plain_readers(named, groups)
    if storage is not None:
        _file_keys(model, named, groups, storage, options)
    return groups, options, budget, measured


def _finer_placed(
    model: nn.Module, named: dict[str, nn.Module], converted: Mapping[int, torch.dtype] | None, options: PlanOptions,
    buffers: int, storage: str | os.PathLike[str],
) -> list[tuple[str, Callable[[], Placed]]]:
    """The finer plans than ``options``' (:func:`_finer`), coarsest first, each placed as it is asked for
    (the host's fallback: the device takes finer groups within what it took the chosen ones in)."""

    def place(finer: PlanOptions) -> Placed:
        groups = _collect(named, find_groups(model, "leaves", _WHAT), finer.dtype, finer.storage_dtype,
                          finer.master_dtype, finer.skip, converted)
        return _placed(model, named, groups, converted, finer, buffers, None, storage)

    return [(step, functools.partial(place, finer)) for step, finer in _finer(options)]


def _least_budget(
    model: nn.Module, device: str | torch.device | OffloadDevice, converted: Mapping[int, torch.dtype] | None,
    keywords: dict[str, Any],
) -> int:
    """``budget="least"``: the least budget :func:`plan_converted` takes for ``model`` with its other
    ``keywords``, every group streamed."""
    try:
        plan_converted(model, device, converted, budget=0, host_fallback=_quiet, **keywords)
    except BudgetError as refusal:
        return refusal.needed
    return 0
