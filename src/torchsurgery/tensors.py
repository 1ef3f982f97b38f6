"""Convert and load a module's tensors while every reference to them stays valid.

``nn.Module.to()`` keeps parameter objects only when PyTorch's swap flag is set, and
replaces buffers even then; ``load_state_dict(assign=True)`` gives the module new
parameter objects and unties tied weights. Optimizers, hooks and user code holding the
old objects then silently work on dead tensors. Here every parameter and buffer keeps
its Python identity: new data is put into the existing object with
:func:`torch.utils.swap_tensors`, or copied into it in place.

Every operation checks all it can before changing anything, and puts back what it had
changed if something still fails half-way, so a module is never left half converted.

**Undo.** :func:`convert_` and :func:`load_` record an entry in the module's undo log, so
``torchsurgery.restore(model)`` undoes them (newest first, with the other pillars'
surgery) into the same objects:

* a conversion is converted back: each parameter and buffer returns to its device and
  dtype. A lossless conversion (a move, a widening cast) comes back bitwise by itself (a
  NaN stays a NaN, though a cast may change its payload bits); for one that loses
  information (``float32 -> bfloat16``, a move to ``meta``) the original values are kept
  in host memory, and every value not changed since the conversion gets its original
  back exactly, while values changed since (by training) keep the change, cast back.
  Gradients and the optimizer's state go back to their device and dtype too, by a cast
  (after a narrowing conversion, their rounding stays).
* a load is taken back: tensors filled in place get back the values they had (kept in
  host memory as the load overwrote them), tensors that got new memory (``meta`` ones
  materialised, moved, cast or assigned) get back what they held before, ``meta``
  included. Loads into the same module one after another, with no other surgery between
  them, share one entry that keeps the first one's values only.

Keeping values costs host memory as large as what is kept, and for a load in place the
time of copying it there (several times the read itself, as the kernel must find new
pages for it; see docs/benchmarks.md); ``undoable=False`` records nothing and keeps
nothing, as ``module.to()`` and ``load_state_dict`` do, and a load in place is then the
reads alone.

**File-backed tensors.** A ``meta`` tensor (or, with ``assign=True``, any tensor) that
:func:`load_` would give the stored bytes unchanged (CPU, same dtype, aligned in the
file) is not copied: it becomes a view of a private memory map of the safetensors file
(of the ``torch.load(mmap=True)`` map for ``.pt`` files; of the state dict's own tensor
for a state dict). Loading is then nearly free; pages come from the page cache when first
used and are the system's file cache, shared and dropped under memory pressure, not the
process's own memory; writing to such a tensor (training, ``mul_``) copies only the pages
written into private memory; the file never changes. The file must stay where it is and
unchanged while the model lives: deleting or replacing it (a new file renamed over it) is
safe, but rewriting it in place changes the values of pages not yet written, and
truncating it makes the process crash (SIGBUS) when a lost page is used. ``copy=True``
gives every loaded tensor memory of its own instead.

Real tensors are read in bulk, straight into their memory (``os.preadv``, several
tensors per system call, threads for large or sharded checkpoints on machines with 4 or
more cores). Every key, shape and the file's header are checked before the first write.
An undoable load keeps the values about to be overwritten aside first, so a load that
fails for any reason (an I/O error, a file cut short after its header was read,
``KeyboardInterrupt``) leaves every tensor exactly as it was. With ``undoable=False``
nothing is kept: a read failing after the checks (those same causes) leaves some tensors
with the checkpoint's values, and raises a ``RuntimeError`` saying so (an interrupt
stays a ``KeyboardInterrupt``).

**Scaled fp8 checkpoints.** In ComfyUI's "fp8 scaled" layout a float8 ``<prefix>.weight``
stands for ``weight.float() * <prefix>.scale_weight`` (one number per weight;
``scale_input`` and a ``scaled_fp8`` marker may come along, and are not needed). Such a
weight loads as those values in the module's dtype (or ``dtype=``, also with
``assign=True``), except into a weight offloaded with a scaled ``storage_dtype``
(:class:`~torchsurgery.compact.Scaled`), which takes the float8 bytes and the scale as
stored. The scale keys are understood, not unexpected; a scale that cannot be one (another
shape, or for a weight that is not float8) is refused with the other mismatches.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._checkpoint import (
    CheckpointError,
    Entry,
    ScaledKeys,
    Source,
    Stash,
    open_source,
    read_scaled,
    scaled_keys,
)
from torchsurgery._names import near_matches
from torchsurgery._swap import swap_blocker, swap_in, wrap_like
from torchsurgery._validate import check_device, check_dtype
from torchsurgery.compact import (
    OffloadedTensor,
    dequantize,
    load_scaled,
    own_scale,
    rescale,
    stored_values,
)

__all__ = ["swap_on_conversion", "convert_", "load_", "LoadResult", "skeleton", "CheckpointError"]

M = TypeVar("M", bound=nn.Module)

_flag_lock = threading.Lock()
_flag_depth = 0
_flag_saved = False


@contextlib.contextmanager
def swap_on_conversion() -> Iterator[None]:
    """Make ``module.to()``/``.half()``/``load_state_dict`` use ``swap_tensors`` inside the block.

    Sets ``torch.__future__.set_swap_module_params_on_conversion(True)`` and restores the
    previous value on exit, also on an exception; nested and concurrent blocks keep the
    flag on until the last one exits.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> layer = nn.Linear(2, 2)
        >>> weight = layer.weight
        >>> with torchsurgery.swap_on_conversion():
        ...     _ = layer.half()
        >>> layer.weight is weight, layer.weight.dtype
        (True, torch.float16)
    """
    global _flag_depth, _flag_saved
    with _flag_lock:
        if _flag_depth == 0:
            _flag_saved = torch.__future__.get_swap_module_params_on_conversion()
            torch.__future__.set_swap_module_params_on_conversion(True)
        _flag_depth += 1
    try:
        yield
    finally:
        with _flag_lock:
            _flag_depth -= 1
            if _flag_depth == 0:
                torch.__future__.set_swap_module_params_on_conversion(_flag_saved)


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """Each distinct parameter and buffer once, as (first qualified name, tensor, is_param)."""
    seen: set[int] = set()
    found: list[tuple[str, torch.Tensor, bool]] = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            found.append((name, p, True))
    for name, b in module.named_buffers(remove_duplicate=False):
        if id(b) not in seen:
            seen.add(id(b))
            found.append((name, b, False))
    return found


@contextlib.contextmanager
def _own_weakrefs_released(module: nn.Module) -> Iterator[None]:
    """Drop the weak references RNN modules keep to their own weights while we swap them.

    ``nn.RNNBase`` keeps ``_flat_weight_refs`` (weakrefs to its parameters), which
    ``swap_tensors`` refuses; PyTorch's own ``_apply`` clears and rebuilds them likewise.
    """
    rnns = [m for m in module.modules() if isinstance(m, nn.RNNBase)]
    for rnn in rnns:
        rnn._flat_weight_refs = []
    try:
        yield
    finally:
        for rnn in rnns:
            rnn._init_flat_weights()


def _converted(t: torch.Tensor, device: torch.device | None, dtype: torch.dtype | None, non_blocking: bool) -> torch.Tensor:
    target_dtype = dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else t.dtype
    if t.is_meta and device is not None and device.type != "meta":
        # nothing to copy out of a meta tensor: allocate, as Module.to_empty does
        return torch.empty_like(t, device=device, dtype=target_dtype)
    return t.detach().to(device=device or t.device, dtype=target_dtype, non_blocking=non_blocking)


def _loses(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether ``after`` (``before`` converted) may have lost some of ``before``'s values."""
    if before.is_meta or before.dtype == after.dtype and not after.is_meta:
        return False
    if after.is_meta or before.dtype.is_complex and not after.dtype.is_complex:
        return True
    was, now = torch.finfo(before.dtype), torch.finfo(after.dtype)
    # fewer mantissa bits, a smaller range, or coarser subnormals
    return now.eps > was.eps or now.max < was.max or now.smallest_normal * now.eps > was.smallest_normal * was.eps


class _Swap(NamedTuple):
    """One tensor to swap new content into, and where its gradient goes along."""

    name: str
    tensor: torch.Tensor
    new: torch.Tensor  # after the swap, this object holds the tensor's old content
    device: torch.device | None
    dtype: torch.dtype | None


def _swap_all(plan: list[_Swap], non_blocking: bool, what: str, *, undo: bool = False) -> None:
    """Swap every new content in, converting gradients along; all or nothing.

    An ``undo`` goes through where the graph of a live output holds a tensor (see ``swap_in``).
    """
    for item in plan:
        problem = swap_blocker(item.name, item.tensor, item.new, what, pending_backward_ok=undo)
        if problem:
            raise RuntimeError(problem)
    done: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    try:
        for name, t, new, device, dtype in plan:
            grad = t.grad
            if grad is not None:
                t.grad = None  # the grad slot counts as a holder for swap_tensors
            try:
                swap_in(t, new, pending_backward_ok=undo)
            except Exception as exc:
                if grad is not None:
                    t.grad = grad
                raise RuntimeError(f"{what}: swapping {name!r} failed: {exc}") from exc
            done.append((t, new, grad))
            if grad is not None:
                t.grad = _converted(grad, device, dtype, non_blocking)
    except BaseException:
        for t, old, grad in reversed(done):
            t.grad = None
            swap_in(t, old, pending_backward_ok=undo)
            t.grad = grad
        raise


class _Converted(NamedTuple):
    """A tensor :func:`convert_` changed, and what undoing the conversion gives back."""

    name: str
    tensor: torch.Tensor
    device: torch.device
    dtype: torch.dtype
    original: torch.Tensor | None  # on the host, kept where the conversion lost values


class _StateMoved(NamedTuple):
    """An optimizer state tensor :func:`convert_` moved, and where it was."""

    param: torch.Tensor
    key: str
    device: torch.device
    dtype: torch.dtype


def _restored(item: _Converted) -> torch.Tensor:
    """The content ``item.tensor`` gets back when its conversion is undone."""
    now = item.tensor.detach()
    if item.original is None:
        return _converted(now, item.device, item.dtype, False)
    if now.is_meta:
        return item.original.to(item.device)
    here = now.to("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a complex -> real conversion warns that it drops the imaginary part
        made = item.original.to(now.dtype)
    # what still equals the conversion's result was not changed since: the original, exactly
    untouched = (here == made) | (here.isnan() & made.isnan())
    return torch.where(untouched, item.original, here.to(item.dtype)).to(item.device)


class ConvertRecord(_undo.Record):
    """The undo-log entry of one :func:`convert_`."""

    kind = "convert"

    def __init__(
        self, target: str, converted: list[_Converted], optimizer: torch.optim.Optimizer | None, moved: list[_StateMoved]
    ) -> None:
        super().__init__()
        self.target = target
        self.converted = converted
        self.optimizer = None if optimizer is None else weakref.ref(optimizer)
        self.moved = moved

    def describe(self) -> str:
        kept = sum(c.original is not None for c in self.converted)
        return f"convert to {self.target} ({len(self.converted)} tensors" + (f", {kept} originals kept)" if kept else ")")

    def undo(self, module: nn.Module) -> None:
        plan = [_Swap(c.name, c.tensor, wrap_like(c.tensor, _restored(c)), c.device, c.dtype) for c in self.converted]
        with _own_weakrefs_released(module):
            _swap_all(plan, False, "torchsurgery.restore", undo=True)
        optimizer = None if self.optimizer is None else self.optimizer()
        state = {} if optimizer is None else optimizer.state
        for param, key, device, dtype in self.moved:
            value = state.get(param, {}).get(key)
            if isinstance(value, torch.Tensor):
                state[param][key] = value.to(device=device, dtype=dtype)
        _undo.remove(module, self)

    def __getstate__(self) -> dict[str, Any]:
        # a copy of the module is not trained by this optimizer: its undo leaves the optimizer alone
        return {**self.__dict__, "optimizer": None, "moved": []}


def _check_conversion(
    module: nn.Module, device: Any, dtype: Any, optimizer: Any, undoable: Any, what: str
) -> tuple[torch.device | None, torch.dtype | None]:
    """``convert_``'s arguments checked, and the module free to convert; the target device and dtype."""
    _undo.check_not_compiling("convert_")
    _undo.check_module(module, what)
    target_device = check_device(device, what)
    target_dtype = check_dtype(dtype, what, complex_ok=True)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(undoable, bool):
        raise TypeError(f"{what}: undoable must be True or False, got {undoable!r}")
    holder = _undo.holder_of_any(t for _, t, _ in _named_tensors(module))
    if holder:
        raise RuntimeError(
            f"{what}: the module's weights are held by {holder}, which would keep computing with "
            "its own copies; remove it first (handle.remove() or torchsurgery.restore), then convert"
        )
    return target_device, target_dtype


def convert_(
    module: M, device: str | torch.device | None = None, dtype: torch.dtype | None = None, *,
    optimizer: torch.optim.Optimizer | None = None, non_blocking: bool = False, undoable: bool = True,
) -> M:
    """Move and/or cast ``module``'s parameters and buffers in place, keeping every object.

    Each parameter and buffer keeps its ``id`` (buffers too, unlike ``module.to()``), tied
    parameters stay one object, ``.grad`` and (with ``optimizer``) the state of the module's
    parameters (Adam's ``exp_avg``...) follow. Only floating point and complex tensors change
    dtype, as with ``module.to(dtype)``; ``meta`` tensors moved to a real device are allocated
    uninitialised, as ``module.to_empty(device=...)`` does (fill them with :func:`load_`).
    All or nothing: every swap is checked first (weak references, extra holders such as a
    pending backward, slot mismatches), and a failure half-way swaps back what was done.
    ``torchsurgery.restore`` converts back exactly (see the module's documentation).

    Args:
        module: the module to convert.
        device: the target device; ``None`` keeps each tensor's device.
        dtype: the target floating point dtype; ``None`` keeps each dtype.
        optimizer: an optimizer over (some of) the module's parameters.
        non_blocking: passed to ``Tensor.to``.
        undoable: record the conversion in the undo log (keeping originals a lossy one
            needs); ``False`` keeps and records nothing, as ``module.to()``.

    Returns:
        ``module`` itself.

    Raises:
        TypeError: an argument is of the wrong kind.
        ValueError: ``device`` or ``dtype`` is not usable.
        RuntimeError: a tensor cannot be swapped; the message names it, the cause and the fix.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> bn = nn.BatchNorm1d(3)
        >>> mean, before = bn.running_mean, bn.weight.detach().clone()
        >>> _ = torchsurgery.convert_(bn, dtype=torch.bfloat16)
        >>> bn.running_mean is mean, bn.running_mean.dtype
        (True, torch.bfloat16)
        >>> _ = torchsurgery.restore(bn)
        >>> bn.running_mean is mean, bn.running_mean.dtype, torch.equal(bn.weight, before)
        (True, torch.float32, True)
    """
    what = "torchsurgery.convert_"
    target_device, target_dtype = _check_conversion(module, device, dtype, optimizer, undoable, what)

    with _own_weakrefs_released(module):
        plan = _plan_conversion(module, target_device, target_dtype, non_blocking, what)
        before = [(item.tensor.device, item.tensor.dtype, _loses(item.tensor, item.new)) for item in plan]
        _swap_all(plan, non_blocking, what)
    moved = [] if optimizer is None else _move_state(optimizer, module, target_dtype is not None, non_blocking)
    if undoable and (plan or moved):
        target = ", ".join(str(x) for x in (target_device, target_dtype) if x is not None)
        _undo.push(module, ConvertRecord(target, _kept(plan, before), optimizer, moved))
    return module


def _kept(plan: list[_Swap], before: list[tuple[torch.device, torch.dtype, bool]]) -> list[_Converted]:
    """What the undo of a conversion needs of each swapped tensor: where it was, and its values where lost."""
    # after the swap, plan[i].new holds the old content: keep it where values were lost
    return [
        _Converted(item.name, item.tensor, device, dtype, item.new.detach().to("cpu") if lossy else None)
        for item, (device, dtype, lossy) in zip(plan, before, strict=True)
    ]


def _plan_conversion(
    module: nn.Module, device: torch.device | None, dtype: torch.dtype | None, non_blocking: bool, what: str
) -> list[_Swap]:
    """The tensors of ``module`` that change, with their converted content; checked before it is made."""
    plan: list[_Swap] = []
    for name, t, _is_param in _named_tensors(module):
        if (device is None or t.device == device) and (
            dtype is None or t.dtype == dtype or not (t.is_floating_point() or t.is_complex())
        ):
            continue
        if isinstance(t, OffloadedTensor):
            # its undo would give back a plain tensor of the dtype it reads as, not the stored values
            raise RuntimeError(
                f"{what}: {name!r} reads as {t.dtype} while its values are kept in {t.stored.dtype} "
                "(DynamicSwapInstaller.install_model(..., dtype=)); uninstall_model() first, convert, and install again"
            )
        problem = swap_blocker(name, t, None, what)
        if problem:
            raise RuntimeError(problem)
        plan.append(_Swap(name, t, wrap_like(t, _converted(t, device, dtype, non_blocking)), device, dtype))
    return plan


def _move_state(optimizer: torch.optim.Optimizer, module: nn.Module, cast: bool, non_blocking: bool) -> list[_StateMoved]:
    """Put the optimizer state of ``module``'s parameters on their device (in their dtype when ``cast``)."""
    moved: list[_StateMoved] = []
    for param in [t for _, t, is_param in _named_tensors(module) if is_param]:
        state = optimizer.state.get(param, {})
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or key == "step":
                continue  # the step counter keeps its dtype and device, as in Optimizer.load_state_dict
            dtype = param.dtype if cast and (value.is_floating_point() or value.is_complex()) else value.dtype
            if value.device != param.device or value.dtype != dtype:
                moved.append(_StateMoved(param, key, value.device, value.dtype))
                state[key] = value.to(device=param.device, dtype=dtype, non_blocking=non_blocking)
    return moved


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
    with contextlib.closing(open_source(source, what)) as reader, _own_weakrefs_released(module):
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
            plan.append(_Swap(name, t, old, old.device, old.dtype))
        with _own_weakrefs_released(module):
            _swap_all(plan, False, what, undo=True)
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
            _Swap(item.name, item.tensor, _replacement(item.tensor, value, assign), item.device, item.dtype)
            for item, value in zip(fresh, values, strict=True)
        ]
        _swap_all(swaps, False, what)
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


@contextlib.contextmanager
def skeleton(device: str | torch.device = "meta", include_buffers: bool = False) -> Iterator[None]:
    """Build models inside the block without allocating their parameters.

    Like ``with torch.device("meta")``, but buffers stay real by default: models often
    compute rotary tables or position ids in ``__init__``, and those are not in their
    checkpoints. Fill the model afterwards with :func:`load_`. Everything is put back on
    exit, also on an exception. The redirection applies to every thread while active.

    Args:
        device: where parameters are put (``"meta"``: nowhere).
        include_buffers: put buffers there too.

    Yields:
        Nothing.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> with torchsurgery.skeleton():
        ...     bn = nn.BatchNorm1d(4)
        >>> bn.weight.device.type, bn.running_mean.device.type
        ('meta', 'cpu')
    """
    target = check_device(device, "torchsurgery.skeleton") or torch.device("meta")
    original_param = nn.Module.register_parameter
    original_buffer = nn.Module.register_buffer

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original_param(self, name, param)
        if param is not None and param.device != target:
            self._parameters[name] = wrap_like(param, param.detach().to(target))  # type: ignore[assignment]

    def register_buffer(self: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        if tensor is not None and tensor.device != target:
            tensor = tensor.to(target)
        original_buffer(self, name, tensor, persistent=persistent)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    if include_buffers:
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original_param  # type: ignore[method-assign]
        nn.Module.register_buffer = original_buffer  # type: ignore[method-assign]
