"""``.to(dtype)``, ``.half()``, ``.cuda()``... on an offloaded model: taken through the offload, or refused.

Every module of an offloaded model routes ``Module._apply`` (what ``.to()`` and its kin
call) to :class:`Conversion`. A conversion that changes no tensor (``.to("cpu")`` of a
model offloaded on the CPU, ``.to(device)`` to the device the model computes on) does
nothing; a move to another device is refused; a dtype conversion is taken as the plain
module takes it: each parameter is shown to ``fn`` as it reads (its compute dtype, on the
device it computes on), the offload is planned again with the converted parameters
computing in their new dtype (sizes, residency, ring slots, casts follow; a model kept
whole stays whole), and their values are those of the plain module converted the same way:
read as they computed, then converted (widening is exact, a narrower storage dtype is
kept, narrowing rounds). The conversion is the user's: removing the offload gives the
module back in the dtypes it was converted to.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from torchsurgery._swap import wrap_like
from torchsurgery.compact import OffloadedTensor, converted_by
from torchsurgery.offloading.forward_lock import ForwardLock
from torchsurgery.offloading.pending import hand_over
from torchsurgery.offloading.plan import OffloadPlan, sizes
from torchsurgery.offloading.streams import GroupStreamer

__all__ = ["Conversion", "Reinstalling", "Changes", "dtype_changes", "check_convertible", "grown_budget", "convert_values", "warn_if_unscaled"]

_WHAT = "torchsurgery.offload"

Changes = dict[int, tuple[torch.Tensor, torch.dtype, torch.dtype]]
"""What a conversion changes, by ``id``: (the tensor, the dtype it reads as, the dtype it is converted to)."""

ConvertSubtree = Callable[[nn.Module, str, Callable[[torch.Tensor], torch.Tensor]], bool]
"""Takes ``module.to(...)`` of the subtree ``(module, name)`` with ``fn`` through an active offload
(``False``: the offload is no longer active)."""


class Conversion:
    """Stands in for ``Module._apply`` on an offloaded module (see the module's docstring).

    A copy of the model (``deepcopy``, ``pickle``) carries no offload: its copy refuses
    conversions that would change a tensor.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> with torchsurgery.offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32):
        ...     isinstance(model.__dict__["_apply"], Conversion), model.to(torch.float64)[0].weight.dtype
        (True, torch.float64)
    """

    def __init__(
        self, module: nn.Module, name: str, convert: weakref.WeakMethod[ConvertSubtree] | None = None,
        lock: ForwardLock | None = None,
    ) -> None:
        self.module = module
        self.name = name
        self.convert = convert
        self.lock = lock

    def __getstate__(self) -> dict[str, Any]:
        return {"module": self.module, "name": self.name, "convert": None, "lock": None}

    def __call__(self, fn: Any, recurse: bool = True) -> nn.Module:
        if self.lock is None:
            return self._apply(fn, recurse)
        # whole, between forwards: a forward running (in another thread) ends first, and the next
        # waits for this one; a conversion inside a forward of this thread takes it again
        with self.lock.held():
            if self.module.__dict__.get("_apply") is not self:
                # converted (or removed) by another thread while this one waited: as the module is now
                return self.module._apply(fn, recurse)
            return self._apply(fn, recurse)

    def _apply(self, fn: Any, recurse: bool) -> nn.Module:
        changed = converted_by(self.module, fn)
        if changed is None:  # nothing changes (share_memory_, .to() where it already is): as on the plain module
            return nn.Module._apply(self.module, fn, recurse)
        convert = self.convert() if self.convert is not None else None
        if convert is not None and convert(self.module, self.name, fn):
            return self.module
        where = f"{self.name}.{changed}" if self.name else changed
        raise RuntimeError(
            f"{_WHAT}: cannot convert {self.name or '<root>'} ({type(self.module).__name__}) with .to(), .half() "
            f"or the like ({where!r} would change): it is a copy of an offloaded module, whose weights live in "
            "the original's offload. Remove the offload before copying (handle.remove() or torchsurgery.restore(model))"
        )


class Reinstalling(Conversion):
    """Stands in for ``Module._apply`` while a conversion takes the offload off and installs it again.

    The converting thread holds the lock: its own ``_apply`` calls (converting the values) are the
    plain module's. A conversion of another thread waits for the lock, then goes through what the
    module has by then (the new installation's :class:`Conversion`, or the plain method): never
    between the removal and the new installation, where the weights are the plain module's.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torchsurgery.offloading.forward_lock import ForwardLock
        >>> layer, lock = nn.Linear(2, 2), ForwardLock()
        >>> layer.__dict__["_apply"] = Reinstalling(layer, "", None, lock)
        >>> with lock.held():
        ...     layer.double().weight.dtype
        torch.float64
    """

    def _apply(self, fn: Any, recurse: bool) -> nn.Module:
        # the module's class's own (an installer's converts its weights as installed)
        return type(self.module)._apply(self.module, fn, recurse)


def dtype_changes(
    module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device, label: str
) -> Changes:
    """What ``fn`` changes in ``module``'s subtree, each parameter shown as it reads (on ``device``).

    Raises:
        RuntimeError: ``fn`` moves a tensor to another device, or gives one new values of the
            same dtype (``to_empty``).
    """
    changes: Changes = {}
    with torch.no_grad():
        for qual, t in [*module.named_parameters(), *module.named_buffers()]:
            shown = torch.empty(0, dtype=t.dtype, device=device if isinstance(t, nn.Parameter) else t.device)
            after = fn(shown)
            if after.device != shown.device:
                raise RuntimeError(
                    f"{_WHAT}: cannot move {label} to {after.device} while it is offloaded to {device} "
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
    return changes


def check_convertible(label: str, plan: OffloadPlan, streamers: Mapping[str, GroupStreamer]) -> None:
    """Refuse a dtype conversion while a streamed group runs.

    Raises:
        RuntimeError: a streamed group runs (inside its forward).
    """
    running = [name for name, streamer in streamers.items() if streamer.depth > 0]
    if running:
        raise RuntimeError(
            f"{_WHAT}: cannot convert {label} while the streamed group {running[0] or '<root>'!r} runs (inside its "
            "forward its weights are in use): convert before or after the group's forward"
        )


def grown_budget(model: nn.Module, plan: OffloadPlan, options: dict[str, Any], converted: Mapping[int, torch.dtype]) -> dict[str, Any]:
    """``offload()``'s ``options`` for the converted model: a model kept whole stays whole, as the plain
    module would (its budget grows by what the conversion adds)."""
    options = dict(options)
    # (budget="least" follows the model by itself: planned again, it is the converted model's least)
    if all(g.resident for g in plan.groups) and isinstance(options.get("budget"), int):
        o = options
        grown, _, _ = sizes(model, _WHAT, dtype=o["dtype"], storage_dtype=o["storage_dtype"], groups=o["groups"],
                            skip=o["skip"], converted=converted, device=plan.offload_device, prefetch=plan.prefetch)
        options["budget"] = max(int(options["budget"]), grown)
    return options


def convert_values(module: nn.Module, changes: Changes, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
    """Once the offload is removed: the changed tensors converted as the offloaded module read them.

    Returns:
        What puts them back as they were (the contents swapped out are kept until then).
    """
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for t, read_as, dtype in changes.values():
            if not isinstance(t, OffloadedTensor):
                # as the offloaded module read it (the compute dtype), then converted
                # (a graph recorded before the conversion hands its gradient on to the converted weight)
                replacement = wrap_like(t, t.detach().to(read_as).to(dtype))
                hand_over(t, replacement)
                swapped.append((t, replacement))  # the replacement holds the content swapped out
        # weights that read as another dtype or device than they keep (an installer's): as
        # their own modules convert them, so that they go on reading as installed
        wrapped = [m for m in module.modules()
                   if any(isinstance(t, OffloadedTensor) and id(t) in changes for t in [*m._parameters.values(), *m._buffers.values()])]
        for m in wrapped:
            m._apply(fn, recurse=False)

    def undo() -> None:
        with torch.no_grad():
            for t, content in reversed(swapped):
                hand_over(t, content)
            back = {id(t): read_as for t, read_as, _ in changes.values() if isinstance(t, OffloadedTensor)}
            for m in wrapped:
                m._apply(lambda t: t.to(back[id(t)]) if id(t) in back else t, recurse=False)

    return undo


def warn_if_unscaled(plan: OffloadPlan, named: Mapping[str, nn.Module], changes: Changes) -> None:
    """One warning where a conversion takes weights out of a :class:`~torchsurgery.compact.Scaled`
    format: converted, they are kept whole (the values of the plain module converted alike: a
    scale chosen again from them would change them), which takes 2 to 8 times the memory."""
    found = [(p, changes[id(p.lookup_in(named))]) for g in plan.groups for p in g.params
             if p.scaled is not None and p.tied_to is None and id(p.lookup_in(named)) in changes]
    if found:
        (first, (_, _, dtype)), count = found[0], len(found)
        warnings.warn(
            f"{_WHAT}: converting to {dtype} takes {count} weight(s) out of the scaled format {first.scaled} "
            f"(e.g. {first.name!r}): they are no longer kept as narrow values and a scale, but whole (2 to 8 "
            "times the memory), with the values of the plain module converted alike; to keep them scaled, remove "
            f"the offload, convert the model, and offload it again with storage_dtype={first.scaled}",
            UserWarning, stacklevel=5,
        )
