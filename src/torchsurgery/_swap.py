"""Putting new data into an existing tensor object: what ``swap_tensors`` needs and refuses.

Shared by the pillars that keep a parameter's identity while changing its data (tensors,
offloading).
"""

from __future__ import annotations

import copy
import copyreg
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["wrap_like", "swap_blocker", "swap_in", "user_attributes", "copy_of", "HELD_KEY"]

HELD_KEY = "_torchsurgery_held"
"""The ``__dict__`` key of the mark ``torchsurgery._undo.hold`` puts on a tensor object: it marks
the object (another surgery depends on it by identity), not its content, so a swap leaves it on
the object."""


def user_attributes(tensor: torch.Tensor) -> dict[str, object]:
    """Attributes set on a tensor object by its user (not torch's ``_is_param``, not ours)."""
    return {k: v for k, v in tensor.__dict__.items() if k != "_is_param" and not k.startswith("_torchsurgery_")}


def copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``'s values as kept, to be written back with ``tensor.detach().copy_(it)``.

    A wrapper subclass (an offloaded weight) copies its inner tensors exactly: ``clone()``
    would give its values in the dtype it reads as, which may round them.
    """
    if is_traceable_wrapper_subclass(tensor):
        return copy.deepcopy(tensor.detach())
    return tensor.detach().clone()


def wrap_like(original: torch.Tensor, data: torch.Tensor, kind: type | None = None) -> torch.Tensor:
    """``data`` as an object of ``original``'s kind (or of class ``kind``), ready to be swapped into it.

    ``swap_tensors`` swaps the objects' ``__dict__`` too: where the result is a plain
    tensor or parameter, attributes the user set on ``original`` are carried over, so the
    swap keeps them (a subclass's ``__dict__`` is its own state, which ``data`` carries).
    """
    kind = type(original) if kind is None else kind
    data = data.detach()
    if kind is nn.Parameter or (isinstance(original, nn.Parameter) and not issubclass(kind, nn.Parameter)):
        # plain Parameters, and tensor subclasses marked as parameters (_is_param)
        param = nn.Parameter(data, requires_grad=original.requires_grad)
        if type(param) is nn.Parameter:
            param.__dict__.update(user_attributes(original))
        return param
    if issubclass(kind, nn.Parameter):
        # a Parameter subclass: same class and attributes, so the swap changes neither
        new = torch.Tensor._make_subclass(kind, data, original.requires_grad)
        new.__dict__.update(original.__dict__)
        return new
    if data.requires_grad != original.requires_grad and data.is_leaf:
        data.requires_grad_(original.requires_grad)
    if type(data) is torch.Tensor:
        data.__dict__.update(user_attributes(original))
    return data


def swap_blocker(
    name: str,
    tensor: torch.Tensor,
    replacement: torch.Tensor | None,
    what: str,
    *,
    weak_references_ok: bool = False,
    pending_backward_ok: bool = False,
) -> str | None:
    """Why ``swap_tensors(tensor, replacement)`` (or :func:`swap_in`, with ``weak_references_ok``) would fail or poison autograd.

    With ``pending_backward_ok`` (an undo, which must not wait for the user to drop every
    output computed with grad mode on) holders are not counted: the graph of such an output
    may hold the tensor, through its AccumulateGrad node or as a saved leaf, and
    ``swap_in(..., pending_backward_ok=True)`` swaps it anyway (a backward through that
    old graph then raises).
    """
    if not weak_references_ok and weakref.getweakrefs(tensor):
        return (
            f"{what}: cannot swap {name!r}: it has weak references (e.g. a WeakTensorKeyDictionary "
            "or a weakref.ref held somewhere); drop them and try again"
        )
    if replacement is not None:
        slots_now = set(copyreg._slotnames(type(tensor)))  # type: ignore[attr-defined]
        slots_new = set(copyreg._slotnames(type(replacement)))  # type: ignore[attr-defined]
        if slots_now != slots_new:
            return (
                f"{what}: cannot swap {name!r}: its class {type(tensor).__name__} and the converted "
                f"{type(replacement).__name__} have different __slots__; convert with a subclass-aware "
                "__torch_dispatch__ that keeps the class"
            )
    uses = tensor._use_count()  # type: ignore[attr-defined]
    if uses > 1 and not pending_backward_ok:
        # One use is the object itself; an extra one is a view's base reference, another
        # holder in C++, or the AccumulateGrad node of a graph whose backward is pending,
        # which swap_tensors would poison so that the backward fails much later.
        return (
            f"{what}: cannot swap {name!r}: it is held elsewhere ({uses} holders): by the graph of a "
            "forward whose backward has not run yet (or whose outputs are still alive), or by a view "
            "of it. Run backward and drop the outputs (del loss), and delete views of the tensor"
        )
    return None


def _poisoned(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
    raise RuntimeError(
        "torchsurgery: this backward runs through the graph of a forward recorded before an undo "
        "(torchsurgery.restore, unpatch, uninstall or an offload's remove) gave a parameter of it its old "
        "class or data back; its gradient has no parameter to go to. Run the forward again after the undo"
    )


def swap_in(
    tensor: torch.Tensor, replacement: torch.Tensor, *, pending_backward_ok: bool = False, poison: bool = True
) -> None:
    """``torch.utils.swap_tensors(tensor, replacement)``, also where weak references to ``tensor`` exist.

    For a surgery's own undo and redo of tensors it converted itself: ``torch.compile``
    keeps weak references to the parameters it traced (its caches are keyed by object),
    and ``swap_tensors`` refuses any. The object stays the one those caches know; its
    guards see the new class, dtype and memory and recompile. Everything else that
    ``swap_tensors`` checks is checked. A gradient goes along, in the replacement's dtype;
    a hold mark (:data:`HELD_KEY`) stays on ``tensor``.

    With ``pending_backward_ok`` (an undo, which must not wait for the user to drop every
    output computed with grad mode on) the swap also goes through where the graph of such
    an output holds ``tensor``, as ``tensor.data = ...`` goes through for a plain tensor:
    ``swap_tensors`` lets a leaf through only where its AccumulateGrad node is the one other
    holder, but a forward that used the weight itself in a product (``y * self.scale``)
    saved it in the graph too. The graph keeps the old content (what its forward computed
    with); a backward through it raises, as after ``swap_tensors`` (the AccumulateGrad node
    is poisoned), instead of accumulating into the object that now holds the old content.
    Without ``poison`` that backward accumulates into ``replacement`` (which then holds the old
    content): for a caller that hands that gradient on itself.
    """
    grad = tensor.grad
    if grad is not None and replacement.grad is None and replacement.requires_grad:
        # the gradient lives in the tensor's memory record, which the swap replaces: it goes along
        replacement.grad = grad.to(device=replacement.device, dtype=replacement.dtype)
    held = tensor.__dict__.get(HELD_KEY)
    if not pending_backward_ok and not weakref.getweakrefs(tensor):
        torch.utils.swap_tensors(tensor, replacement)
    else:  # swap_tensors refuses weak references (torch.compile's caches hold them) and a saved leaf, both of which we must swap
        _swap_holding(tensor, replacement, pending_backward_ok, poison)
    if held is not None:  # the __dict__ went with the content
        tensor.__dict__[HELD_KEY] = held
        replacement.__dict__.pop(HELD_KEY, None)


def _swap_holding(tensor: torch.Tensor, replacement: torch.Tensor, pending_backward_ok: bool, poison: bool) -> None:
    """``swap_tensors`` where it would refuse: weak references, and (an undo) holders in a live graph."""
    # torch.utils.swap_tensors has no switch for either refusal, so its three steps are taken here
    slots = set(copyreg._slotnames(type(tensor)))  # type: ignore[attr-defined]
    if slots != set(copyreg._slotnames(type(replacement))):  # type: ignore[attr-defined]
        raise RuntimeError(f"cannot swap a {type(tensor).__name__} and a {type(replacement).__name__}: their __slots__ differ")
    for t in (tensor, replacement):
        if t._use_count() > 1 and not pending_backward_ok:  # type: ignore[attr-defined]
            raise RuntimeError(
                "cannot swap a tensor held elsewhere (by the graph of a pending backward, or by a view of it); "
                "run backward and drop its outputs first"
            )
    if poison and tensor._use_count() > 1 and tensor.is_leaf and tensor.requires_grad:  # type: ignore[attr-defined]
        # the node would accumulate into ``replacement``, which gets the old content; a graph that
        # holds the replacement's content accumulates into ``tensor`` from now on, rightly
        torch.autograd.graph.get_gradient_edge(tensor).node.register_prehook(_poisoned)
    mine, theirs = ({name: getattr(t, name) for name in slots if hasattr(t, name)} for t in (tensor, replacement))
    tensor.__class__, replacement.__class__ = replacement.__class__, tensor.__class__
    tensor.__dict__, replacement.__dict__ = replacement.__dict__, tensor.__dict__
    _give_slots(tensor, theirs, mine)
    _give_slots(replacement, mine, theirs)
    torch._C._swap_tensor_impl(tensor, replacement)


def _give_slots(t: torch.Tensor, values: dict[str, object], had: dict[str, object]) -> None:
    """Set ``t``'s slots to ``values``, emptying those it ``had`` that ``values`` lacks."""
    for name in had.keys() - values.keys():
        delattr(t, name)
    for name, value in values.items():
        setattr(t, name, value)
