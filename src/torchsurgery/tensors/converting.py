"""Converting a module's tensors in place (:func:`convert_`), recorded for undo.

The public face and the whole story are :mod:`torchsurgery.tensors`.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._swap import swap_blocker, wrap_like
from torchsurgery._validate import check_device, check_dtype
from torchsurgery.compact import (
    OffloadedTensor,
)
from torchsurgery.tensors.swaps import Swap, converted, own_weakrefs_released, swap_all

__all__ = ["swap_on_conversion", "convert_", "ConvertRecord"]

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


def _loses(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether ``after`` (``before`` converted) may have lost some of ``before``'s values."""
    if before.is_meta or before.dtype == after.dtype and not after.is_meta:
        return False
    if after.is_meta or before.dtype.is_complex and not after.dtype.is_complex:
        return True
    was, now = torch.finfo(before.dtype), torch.finfo(after.dtype)
    # fewer mantissa bits, a smaller range, or coarser subnormals
    return now.eps > was.eps or now.max < was.max or now.smallest_normal * now.eps > was.smallest_normal * was.eps


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
        return converted(now, item.device, item.dtype, False)
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
        plan = [Swap(c.name, c.tensor, wrap_like(c.tensor, _restored(c)), c.device, c.dtype) for c in self.converted]
        with own_weakrefs_released(module):
            swap_all(plan, False, "torchsurgery.restore", undo=True)
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

    with own_weakrefs_released(module):
        plan = _plan_conversion(module, target_device, target_dtype, non_blocking, what)
        before = [(item.tensor.device, item.tensor.dtype, _loses(item.tensor, item.new)) for item in plan]
        swap_all(plan, non_blocking, what)
    moved = [] if optimizer is None else _move_state(optimizer, module, target_dtype is not None, non_blocking)
    if undoable and (plan or moved):
        target = ", ".join(str(x) for x in (target_device, target_dtype) if x is not None)
        _undo.push(module, ConvertRecord(target, _kept(plan, before), optimizer, moved))
    return module


def _kept(plan: list[Swap], before: list[tuple[torch.device, torch.dtype, bool]]) -> list[_Converted]:
    """What the undo of a conversion needs of each swapped tensor: where it was, and its values where lost."""
    # after the swap, plan[i].new holds the old content: keep it where values were lost
    return [
        _Converted(item.name, item.tensor, device, dtype, item.new.detach().to("cpu") if lossy else None)
        for item, (device, dtype, lossy) in zip(plan, before, strict=True)
    ]


def _plan_conversion(
    module: nn.Module, device: torch.device | None, dtype: torch.dtype | None, non_blocking: bool, what: str
) -> list[Swap]:
    """The tensors of ``module`` that change, with their converted content; checked before it is made."""
    plan: list[Swap] = []
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
        plan.append(Swap(name, t, wrap_like(t, converted(t, device, dtype, non_blocking)), device, dtype))
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

