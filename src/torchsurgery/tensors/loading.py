"""Loading a checkpoint into a module's tensors in place (:func:`load_`), recorded for undo.

The public face and the whole story are :mod:`torchsurgery.tensors`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._checkpoint import (
    Entry,
    ScaledKeys,
    Source,
    Stash,
    open_source,
    read_scaled,
    scaled_keys,
)
from torchsurgery._names import near_matches
from torchsurgery._swap import swap_blocker, wrap_like
from torchsurgery._validate import check_device, check_dtype
from torchsurgery.compact import (
    OffloadedTensor,
    dequantize,
    load_scaled,
    own_scale,
    rescale,
    stored_values,
)
from torchsurgery.tensors.swaps import Swap, own_weakrefs_released, swap_all

__all__ = ["load_", "LoadResult", "LoadRecord"]

class LoadResult(NamedTuple):
    """What :func:`load_` could not match.

    Attributes:
        missing_keys: module keys absent from the checkpoint (tied names count as present
            when any name of the tie is).
        unexpected_keys: checkpoint keys the module does not have.

    Example:
        >>> from torch import nn
        >>> import torchsurgery
        >>> torchsurgery.load_(nn.Linear(2, 2), {"weight": nn.Linear(2, 2).weight}, strict=False)
        LoadResult(missing_keys=['bias'], unexpected_keys=[])
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


def _suggest(key: str, names: list[str]) -> str:
    close = near_matches(key, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    return "bool" if dtype == torch.bool else "int"


def _load_errors(
    missing: list[str], unexpected: list[str], mismatched: list[str], strict: bool, ckpt_keys: list[str], module_keys: list[str]
) -> str | None:
    lines = []
    if strict:
        lines += [f"  missing: {k!r}{_suggest(k, unexpected or ckpt_keys)}" for k in missing]
        lines += [f"  unexpected: {k!r}{_suggest(k, missing or module_keys)}" for k in unexpected]
    lines += [f"  {m}" for m in mismatched]
    if not lines:
        return None
    return "torchsurgery.load_: the checkpoint does not fit the module; nothing was loaded:\n" + "\n".join(lines)


def load_(
    module: nn.Module, source: Any, *, strict: bool = True, assign: bool = False,
    device: str | torch.device | None = None, dtype: torch.dtype | None = None, copy: bool = False,
    undoable: bool = True,
) -> LoadResult:
    """Load a checkpoint into ``module`` in place, keeping every object.

    Parameters and buffers keep their ``id`` (optimizers built before loading keep working);
    real tensors receive the values in place (``data_ptr`` unchanged unless the device or
    dtype changes); ``meta`` tensors (from :func:`skeleton`) are materialised on ``device``,
    as views of the file where they can be. Tied weights stay tied whether the checkpoint
    names one or both of their names. Tensor subclasses decide through ``Tensor.module_load``
    (with ``assign=True``, the checkpoint's tensor and class are taken). The module's
    documentation says what ``torchsurgery.restore`` and a load failing half-way give back.

    Args:
        module: the module to load into.
        source: a state dict, a ``.safetensors`` file, a sharded ``*.index.json``, a
            ``.pt``/``.pth``/``.bin`` file (read with ``torch.load(weights_only=True)``),
            or a directory holding one of those under its usual name.
        strict: raise when keys are missing or unexpected (shape mismatches always raise).
        assign: take the checkpoint's tensors instead of copying into the module's.
        device: where ``meta`` tensors are materialised, and where all tensors go when given.
        dtype: cast floating point tensors to this dtype.
        copy: give new tensors memory of their own rather than file-backed views.
        undoable: record the load in the undo log, keeping what it overwrites (which also
            lets a load that fails half-way put every tensor back).

    Returns:
        A :class:`LoadResult` with the missing and unexpected keys.

    Raises:
        RuntimeError: keys or shapes do not fit (all are listed at once, with near names);
            or, with ``undoable=False``, a read failed after the first write.
        CheckpointError: the file is truncated, corrupt, crafted or unsafe.
        FileNotFoundError: the file does not exist.
        TypeError: an argument is of the wrong kind.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> src, dst = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> weight, before = dst.weight, dst.weight.detach().clone()
        >>> torchsurgery.load_(dst, src.state_dict())
        LoadResult(missing_keys=[], unexpected_keys=[])
        >>> dst.weight is weight and torch.equal(dst.weight, src.weight)
        True
        >>> torch.equal(torchsurgery.restore(dst).weight, before)
        True
    """
    what = "torchsurgery.load_"
    target_device, target_dtype = _check_load(module, device, dtype, copy, undoable, what)
    with contextlib.closing(open_source(source, what)) as reader, own_weakrefs_released(module):
        result, record = _load(module, reader, strict, assign, target_device, target_dtype, copy, undoable, what)
    if record is not None:
        _record_load(module, record, source)
    return result


def _check_load(
    module: nn.Module, device: Any, dtype: Any, copy: Any, undoable: Any, what: str
) -> tuple[torch.device | None, torch.dtype | None]:
    """``load_``'s options checked, and the module free to load into; the target device and dtype."""
    _undo.check_not_compiling("load_")
    _undo.check_module(module, what)
    target_device = check_device(device, what)
    target_dtype = check_dtype(dtype, what, complex_ok=True)
    for name, flag in (("copy", copy), ("undoable", undoable)):
        if not isinstance(flag, bool):
            raise TypeError(f"{what}: {name} must be True or False, got {flag!r}")
    return target_device, target_dtype


def _record_load(module: nn.Module, record: LoadRecord, source: Any) -> None:
    """Put ``record`` in ``module``'s log, or into the load recorded right before it."""
    record.source = str(source) if isinstance(source, (str, os.PathLike)) else "a state dict"
    log = _undo.records(module)
    if not (log and isinstance(log[-1], LoadRecord) and log[-1].absorb(record)):
        _undo.push(module, record)


class LoadRecord(_undo.Record):
    """The undo-log entry of one :func:`load_`.

    Attributes:
        overwritten: ``(tensor, values)``: a tensor filled in place and, on the host, what it held.
        replaced: ``(name, tensor, old, (device, dtype))``: a tensor that got new content,
            the object holding its old content (swapped back on undo), and where the load put it.
        source: where the load came from, for listings.
        last, loads: the ``seq`` of the last load taken in (see :meth:`absorb`), and how many.
    """

    kind = "load"

    def __init__(
        self,
        overwritten: list[tuple[torch.Tensor, torch.Tensor]],
        replaced: list[tuple[str, torch.Tensor, torch.Tensor, tuple[torch.device, torch.dtype]]],
    ) -> None:
        super().__init__()
        self.overwritten = overwritten
        self.replaced = replaced
        self.source = "a state dict"
        self.last = self.seq  # the seq of the last load this record took in
        self.loads = 1

    def describe(self) -> str:
        more = f", then {self.loads - 1} more loads" if self.loads > 1 else ""
        return f"load {len(self.overwritten) + len(self.replaced)} tensors from {self.source}{more}"

    def undo(self, module: nn.Module) -> None:
        what = "torchsurgery.restore"
        for t, values in self.overwritten:
            if t.shape != values.shape:
                raise RuntimeError(f"{what}: a loaded tensor now has shape {list(t.shape)}, not {list(values.shape)}")
        plan = []
        for name, t, old, loaded in self.replaced:
            if loaded != (t.device, t.dtype) and not old.is_meta:
                # converted since by surgery undone out of order: the old values as it is now
                old = wrap_like(t, old.detach().to(device=t.device, dtype=t.dtype))
            old.requires_grad_(t.requires_grad)  # a flag set since stays, as with every undo
            plan.append(Swap(name, t, old, old.device, old.dtype))
        with own_weakrefs_released(module):
            swap_all(plan, False, what, undo=True)
        with torch.no_grad():
            for t, values in self.overwritten:
                t.detach().copy_(values)
        _undo.remove(module, self)

    def absorb(self, later: LoadRecord) -> bool:
        """Take in the undo of a load made right after this one into the same module, if it can.

        Loading checkpoints one after another keeps one copy of the first one's values, not
        one per load: undoing both gives back what this load kept, plus the tensors only the
        later one wrote. A later load that gave tensors new memory stays a record of its own.
        """
        if later.replaced or later.seq != self.last + 1:  # a record made between them: keep both
            return False
        covered = {id(t) for t, _ in self.overwritten} | {id(t) for _, t, _, _ in self.replaced}
        self.overwritten += [(t, values) for t, values in later.overwritten if id(t) not in covered]
        self.last = later.seq
        self.loads += 1
        return True

    def __getstate__(self) -> dict[str, Any]:
        # the kept values share one mapping as several dtypes, which torch.save refuses
        return {**self.__dict__, "overwritten": [(t, values.clone()) for t, values in self.overwritten]}


def _match(
    module: nn.Module, stored: dict[str, Entry], strict: bool, scaled: ScaledKeys
) -> tuple[list[tuple[str, torch.Tensor, str]], list[str], list[str]]:
    """(qualified name, tensor, checkpoint key) for every tensor to load, the missing and unexpected keys.

    The keys ``scaled`` understands (scales read with their weights) are neither loaded nor unexpected.

    Raises:
        RuntimeError: keys (when ``strict``), shapes or kinds of dtype do not fit, all listed at once.
    """
    state = module.state_dict(keep_vars=True)
    # group the module's keys by tensor, so tied weights are one entry with several names
    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for key, t in state.items():
        groups.setdefault(id(t), (t, []))[1].append(key)
    missing, mismatched = [], list(scaled.problems)
    plan: list[tuple[str, torch.Tensor, str]] = []
    for t, names in groups.values():
        present = [n for n in names if n in stored]
        if not present:
            missing.extend(names)
            continue
        key = present[0]
        if stored[key].shape != tuple(t.shape):
            mismatched.append(f"shape of {key!r}: checkpoint {list(stored[key].shape)}, module {list(t.shape)}")
        elif _kind(stored[key].dtype) != _kind(t.dtype):
            # float <-> float casts are fine; integers or booleans into floats (or back) are not
            mismatched.append(f"dtype of {key!r}: checkpoint {stored[key].dtype}, module {t.dtype}")
        else:
            plan.append((names[0], t, key))
    claimed = {n for _, names in groups.values() for n in names}
    unexpected = sorted(k for k in stored if k not in claimed and k not in scaled.understood)
    message = _load_errors(missing, unexpected, mismatched, strict, sorted(stored), sorted(state))
    if message:
        raise RuntimeError(message)
    return plan, sorted(missing), unexpected


class _Fresh(NamedTuple):
    """A tensor that gets new memory (then swapped in): what it becomes and from which key."""

    name: str
    tensor: torch.Tensor
    key: str
    device: torch.device
    dtype: torch.dtype


_STAGE_BYTES = 256 * 1024 * 1024  # tensors converted after reading are read this many bytes at a time


def _in_chunks(items: list[Any], sizes: list[int]) -> Iterator[list[Any]]:
    """``items`` in runs of about ``_STAGE_BYTES`` (one item may exceed it alone)."""
    run: list[Any] = []
    total = 0
    for item, size in zip(items, sizes, strict=True):
        if run and total + size > _STAGE_BYTES:
            yield run
            run, total = [], 0
        run.append(item)
        total += size
    if run:
        yield run


def _load(
    module: nn.Module,
    reader: Source,
    strict: bool,
    assign: bool,
    device: torch.device | None,
    dtype: torch.dtype | None,
    copy: bool,
    undoable: bool,
    what: str,
) -> tuple[LoadResult, LoadRecord | None]:
    stored: dict[str, Entry] = reader.entries()
    scaled = scaled_keys(stored, module.state_dict(keep_vars=True).keys())
    matched, missing, unexpected = _match(module, stored, strict, scaled)
    _check_loadable(matched, what)
    in_place, fresh = _plan_load(matched, stored, scaled.scales, assign, device, dtype)
    # first everything that can fail and changes nothing in the module: the new values
    # read or mapped, and (for an undoable load) the values about to be overwritten kept
    # aside, which both the undo and a load failing half-way give back. Without undo nothing
    # is kept: the load is then the reads alone, and a read failing half-way is reported
    values = _new_values(reader, fresh, stored, assign, copy, scaled.scales)
    # what the writes change: each tensor's memory; a scaled weight's q and scale, taken narrow
    written = [w for t, key in in_place for w in _written_by(t, key in scaled.scales)]
    stash = Stash(written) if undoable else None
    try:
        previous = stash.keep() if stash is not None else []
        _read_in_place(reader, in_place, stored, scaled.scales)
        swaps = [
            Swap(item.name, item.tensor, _replacement(item.tensor, value, assign), item.device, item.dtype)
            for item, value in zip(fresh, values, strict=True)
        ]
        swap_all(swaps, False, what)
    except BaseException as exc:
        _failed(stash, bool(in_place), exc, what)
        raise
    finally:
        if stash is not None:
            stash.close()
    result = LoadResult(missing, unexpected)
    if not undoable or not matched:
        return result, None
    # after the swap, each swap's .new holds what its tensor held before
    overwritten = list(zip(written, previous, strict=True))
    return result, LoadRecord(overwritten, [(s.name, s.tensor, s.new, (s.tensor.device, s.tensor.dtype)) for s in swaps])


def _check_loadable(matched: list[tuple[str, torch.Tensor, str]], what: str) -> None:
    """Refuse a load into a tensor that cannot be swapped, or that an offload streams from its file."""
    for name, t, _ in matched:
        problem = swap_blocker(name, t, None, what)
        if problem:
            raise RuntimeError(problem)
        holder = _undo.holder_of_any([t])
        if t.is_meta and holder:
            raise RuntimeError(
                f"{what}: {name!r} is streamed by {holder} from its checkpoint file (storage=), which is what its "
                "forwards read: a load here would not reach them. Remove the offload, load, and offload again "
                "(from a file holding the new values)"
            )


def _plan_load(
    matched: list[tuple[str, torch.Tensor, str]], stored: dict[str, Entry], scales: dict[str, str],
    assign: bool, device: torch.device | None, dtype: torch.dtype | None,
) -> tuple[list[tuple[torch.Tensor, str]], list[_Fresh]]:
    """The tensors filled in place (with their keys), and those that get new memory."""
    in_place: list[tuple[torch.Tensor, str]] = []
    fresh: list[_Fresh] = []
    for name, t, key in matched:
        floating = t.is_floating_point() or t.is_complex()
        target_device = device or (torch.device("cpu") if t.is_meta else t.device)
        target_dtype = dtype if dtype is not None and floating else t.dtype
        # plain tensors, and offloaded weights (written through copy_ into their stored values,
        # which is where their forwards read)
        in_place_kind = type(t) in (torch.Tensor, nn.Parameter, OffloadedTensor)
        if in_place_kind and not assign and not t.is_meta and t.device == target_device and t.dtype == target_dtype:
            in_place.append((t, key))
        else:
            # assign=True without a dtype keeps the checkpoint's dtype (a scaled weight's values: the module's)
            kept = stored[key].dtype if assign and dtype is None and key not in scales else target_dtype
            fresh.append(_Fresh(name, t, key, target_device, kept))
    return in_place, fresh


def _failed(stash: Stash | None, in_place: bool, exc: BaseException, what: str) -> None:
    """After a load failed half-way: put back what it overwrote, or say that nothing was kept to."""
    if stash is not None:
        stash.restore()
    elif in_place and isinstance(exc, Exception):
        raise RuntimeError(
            f"{what}: the load failed after it began writing into the module's tensors ({type(exc).__name__}: "
            f"{exc}); with undoable=False nothing was kept to put back, so some tensors may now hold the "
            "checkpoint's values and others their old ones: load again, or load with undoable=True, which "
            "leaves every tensor as it was when a load fails"
        ) from exc


def _written_by(t: torch.Tensor, scaled: bool) -> list[torch.Tensor]:
    """The tensors a load in place writes for ``t``: a scaled weight given a scaled entry: its narrow
    values and its scale (taken as the file has them), else ``t`` itself."""
    scale = own_scale(t) if scaled else None
    return [t] if scale is None else [stored_values(t), scale]


def _read_in_place(reader: Source, in_place: list[tuple[torch.Tensor, str]], stored: dict[str, Entry], scales: dict[str, str]) -> None:
    """Write each tensor's checkpoint values into it; a scaled entry's as the values ``q * scale`` stand for."""
    plain = [(t, key) for t, key in in_place if key not in scales]
    for run in _in_chunks(plain, [stored[key].dtype.itemsize * t.numel() for t, key in plain]):
        # a scaled weight given plain values takes a scale chosen from them, not the one of the
        # values they replace (larger values would saturate at the old range): read, then rescaled
        plain_values = {id(t): torch.empty(t.shape, dtype=t.dtype) for t, _ in run if own_scale(t) is not None}
        reader.read_many([(key, plain_values.get(id(t), t.detach())) for t, key in run])
        for t, _ in run:
            if id(t) in plain_values:
                rescale(t, plain_values[id(t)])
                continue
            # the bytes went straight into memory: count it as the in-place write it is, so
            # whoever keeps a copy by version (an offload's streamed groups) sees the change
            torch.autograd.graph.increment_version(t)
    narrow = [(t, key) for t, key in in_place if key in scales]
    for run in _in_chunks(narrow, [t.numel() for t, _ in narrow]):
        for (t, _), (q, scale) in zip(run, read_scaled(reader, [(key, scales[key]) for _, key in run]), strict=True):
            if isinstance(t, OffloadedTensor) and own_scale(t) is not None:
                load_scaled(t, q, scale)
            else:
                with torch.no_grad():
                    t.detach().copy_(dequantize(q, scale.to(q.device), t.dtype))


def _new_values(
    reader: Source, fresh: list[_Fresh], stored: dict[str, Entry], assign: bool, copy: bool, scales: dict[str, str]
) -> list[torch.Tensor]:
    """The content of each tensor in ``fresh``: mapped where it can be, else read and converted (a scaled
    entry: the values ``q * scale`` stand for)."""
    values: dict[int, torch.Tensor] = {}
    to_read: list[int] = []
    for i, item in enumerate(fresh):
        # only tensors that get new memory anyway may take the checkpoint's own
        mappable = not copy and (item.tensor.is_meta or assign) and stored[item.key].dtype == item.dtype
        mappable = mappable and item.key not in scales
        value = reader.mapped(item.key) if mappable else None
        if value is not None and value.device == item.device and value.dtype == item.dtype:
            values[i] = value
        else:
            to_read.append(i)
    sizes = [stored[fresh[i].key].dtype.itemsize * fresh[i].tensor.numel() for i in to_read]
    for run in _in_chunks(to_read, sizes):
        # a run at a time, so that converting (a cast, a move to a GPU) needs only a run's
        # worth of extra memory
        taken = reader.take([fresh[i].key for i in run], copy=copy)
        for i, value in zip(run, taken, strict=True):
            scale = scales.get(fresh[i].key)
            if scale is not None:
                value = dequantize(value, reader.read(scale).float().reshape(()), fresh[i].dtype)
            values[i] = value.to(device=fresh[i].device, dtype=fresh[i].dtype)
    return [values[i] for i in range(len(fresh))]


def _replacement(t: torch.Tensor, value: torch.Tensor, assign: bool) -> torch.Tensor:
    """The object swapped into ``t`` to give it ``value``."""
    if type(t) in (torch.Tensor, nn.Parameter) and not assign:
        # a meta tensor to materialise, or a move/cast: the loaded value becomes the content
        return wrap_like(t, value)
    # tensor subclasses decide through module_load (assign=True: the checkpoint's tensor)
    with torch.no_grad():
        loaded = t.module_load(value, assign=assign)
    return wrap_like(t, loaded) if isinstance(t, nn.Parameter) else loaded

