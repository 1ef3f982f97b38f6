"""``HookFunction``: what to capture and how to edit it, for one module (or a glob of them).

A HookFunction is a description; it holds no per-model state, so the same object can
be registered in several :class:`~torchsurgery.FlexModel` wrappers. Registering it makes
one :class:`Binding` per module (or parameter) it names: the wrapper's record of where
the hook sits, under which ``output_ptr`` key, and the torch hook that runs it.
"""

from __future__ import annotations

import weakref
from argparse import Namespace
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

HookType = Literal["forward", "forward_pre", "full_backward", "full_backward_pre", "tensor"]
"""Which PyTorch hook runs a HookFunction (``tensor``: a parameter's gradient hook)."""

HOOK_TYPES: tuple[HookType, ...] = ("forward", "forward_pre", "full_backward", "full_backward_pre", "tensor")
GRADIENT_HOOK_TYPES: tuple[HookType, ...] = ("full_backward", "full_backward_pre", "tensor")
"""The hook types that run during the backward."""

Shape = tuple[int | None, ...]
"""A shape whose ``None`` entries match any size."""

Edit = Callable[[torch.Tensor], torch.Tensor]
"""Runs a hook's editing function on the full tensor (and checks what it returns)."""


def shape_hint(value: Sequence[int | None] | None, what: str) -> Shape | None:
    """``value`` checked as an ``expected_shape``: sizes or ``None`` entries, as a tuple.

    Raises:
        ValueError: not a sequence, or an entry that is neither a size nor ``None``.

    Example:
        >>> shape_hint([None, 16], "torchsurgery.HookFunction")
        (None, 16)
    """
    if value is None:
        return None
    if not isinstance(value, (list, tuple, torch.Size)):
        raise ValueError(
            f"{what}: expected_shape must be a sequence of sizes or None, e.g. (None, 16), got {value!r}"
        )
    shape = tuple(value)
    if not all(d is None or (isinstance(d, int) and d >= 0) for d in shape):
        raise ValueError(f"{what}: expected_shape must hold sizes or None, got {shape!r}")
    return shape


EditingFunction = Callable[[nn.Module, torch.Tensor, Namespace, nn.ModuleDict], torch.Tensor]
"""``f(current_module, inputs, save_ctx, modules) -> Tensor``, as in flex_model."""


def default_editing_function(
    current_module: nn.Module, inputs: torch.Tensor, save_ctx: Namespace, modules: nn.ModuleDict
) -> torch.Tensor:
    """Return the activation unchanged (capture only).

    Example:
        >>> import torch
        >>> from argparse import Namespace
        >>> from torch import nn
        >>> t = torch.ones(1)
        >>> default_editing_function(nn.Identity(), t, Namespace(), nn.ModuleDict()) is t
        True
    """
    return inputs


class HookFunction:
    """Capture and optionally edit the activation of a named submodule.

    Same names and arguments as ``flex_model.core.HookFunction``, so code written for
    flex_model switches by changing an import.

    Args:
        module_name: qualified name of the submodule (of the parameter, for tensor
            hooks), or a glob such as ``"model.layers.*.mlp"``, which expands to one
            hook per match when registered.
        expected_shape: shape of the full activation; ``None`` entries are filled in.
            In one process it is checked against the real activation; in distributed
            runs it tells which dimensions are sharded.
        editing_function: ``f(current_module, inputs, save_ctx, modules) -> Tensor``; the
            default returns its input (capture only).
        unpack_idx: which tensor leaf of the module's (nested) output or input to use.
        allow_shape_change: let the editing function return a differently shaped tensor.
        edit_on: in distributed runs, ``"all"`` (default) runs the editing function on
            every rank, on identical input, so only the input travels; ``"rank0"`` runs it
            on the first rank of the ranks sharing that input and broadcasts the result,
            for edits that are not deterministic (the result is then a constant for
            autograd on every rank).
        edit_batch: with data parallelism, ``"global"`` (default) gives the editing
            function the whole batch gathered from every data-parallel rank (the same
            input as one process on that batch); ``"local"`` gives it this rank's rows
            only, which saves the gather.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> out = {}
        >>> flex = torchsurgery.FlexModel(model, out)
        >>> flex.register_forward_hook(torchsurgery.HookFunction("0", editing_function=lambda m, x, ctx, mods: x * 0))
        >>> flex(torch.ones(1, 2)).abs().sum().item(), list(out)
        (0.0, ['0'])
        >>> _ = flex.restore()
    """

    def __init__(
        self,
        module_name: str,
        expected_shape: Sequence[int | None] | None = None,
        editing_function: EditingFunction | None = None,
        unpack_idx: int = 0,
        *,
        allow_shape_change: bool = False,
        edit_on: str = "all",
        edit_batch: str = "global",
    ) -> None:
        if not isinstance(module_name, str):
            raise TypeError(f"torchsurgery.HookFunction: module_name must be a str, got {module_name!r}")
        if editing_function is not None and not callable(editing_function):
            raise TypeError(
                f"torchsurgery.HookFunction: editing_function must be callable, got {editing_function!r}"
            )
        if not isinstance(unpack_idx, int) or unpack_idx < 0:
            raise ValueError(f"torchsurgery.HookFunction: unpack_idx must be an int >= 0, got {unpack_idx!r}")
        if edit_on not in ("all", "rank0"):
            raise ValueError(f"torchsurgery.HookFunction: edit_on must be 'all' or 'rank0', got {edit_on!r}")
        if edit_batch not in ("global", "local"):
            raise ValueError(
                f"torchsurgery.HookFunction: edit_batch must be 'global' or 'local', got {edit_batch!r}"
            )
        self.module_name = module_name
        self.expected_shape = shape_hint(expected_shape, "torchsurgery.HookFunction")
        self.editing_function: EditingFunction = editing_function or default_editing_function
        self.unpack_idx = unpack_idx
        self.allow_shape_change = allow_shape_change
        self.edit_on = edit_on
        self.edit_batch = edit_batch

    def __call__(self, *args: Any) -> Any:
        """Run as a plain torch hook, as the wrapper that registered it last runs it.

        flex_model lets code hand a registered HookFunction to PyTorch directly
        (``module.register_forward_hook(hook_function)``); it then captures into that
        wrapper's ``output_ptr`` under the key of its first module and edits like the
        wrapper's own hook of the same type, in the wrapper's groups.

        Raises:
            RuntimeError: it was never registered with a FlexModel, or that wrapper was
                restored.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> import torchsurgery
            >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            >>> out = {}
            >>> flex = torchsurgery.FlexModel(model, out)
            >>> hook = torchsurgery.HookFunction("0")
            >>> flex.register_forward_hook(hook)
            >>> handle = model[1].register_forward_hook(hook)  # the same capture, on another module
            >>> _ = flex(torch.ones(1, 2))
            >>> len(out["0"])
            2
            >>> handle.remove(); _ = flex.restore()
        """
        binding = _LAST_BINDING.get(self)
        if binding is None or binding.handle is None or binding.torch_hook is None:
            state = "was restored" if binding is not None else "is not registered with a FlexModel"
            raise RuntimeError(
                f"torchsurgery.HookFunction.__call__: {self!r} {state}; register it first "
                "(flex.register_forward_hook(hook) and the like): that tells it its hook type and output_ptr"
            )
        return binding.torch_hook(*args)

    @property
    def edits(self) -> bool:
        """Whether this hook has an editing function (not just capture)."""
        return self.editing_function is not default_editing_function

    def __repr__(self) -> str:
        extra = f", expected_shape={self.expected_shape}" if self.expected_shape else ""
        return f"HookFunction({self.module_name!r}{extra}, edits={self.edits})"


@dataclass(eq=False)
class Binding:
    """One HookFunction bound to one module (or parameter) of one wrapper.

    Attributes:
        hook: the HookFunction.
        hook_type: which PyTorch hook runs it.
        name: the qualified name of the module (or parameter) it is bound to.
        key: where its captures go in ``output_ptr`` (``name``, or ``name#2``... when
            several hooks share the module).
        handle: removes the torch hook; ``None`` once removed.
        torch_hook: the callable PyTorch runs.

    Example:
        >>> binding = Binding(HookFunction("fc"), "forward", "fc", "fc")
        >>> binding.key, binding.handle is None
        ('fc', True)
    """

    hook: HookFunction
    hook_type: HookType
    name: str
    key: str
    handle: RemovableHandle | None = None
    torch_hook: Callable[..., Any] | None = None

    def remove(self) -> None:
        """Take the torch hook off (again: nothing)."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


# A HookFunction called directly as a torch hook acts as its last registration made it.
_LAST_BINDING: weakref.WeakKeyDictionary[HookFunction, Binding] = weakref.WeakKeyDictionary()


def remember_binding(binding: Binding) -> None:
    """Make ``binding`` the one ``binding.hook(...)`` runs when called as a torch hook.

    Example:
        >>> fc = nn.Linear(1, 1)
        >>> hook = HookFunction("fc")
        >>> binding = Binding(hook, "forward", "fc", "fc", torch_hook=lambda module, args, out: out * 0)
        >>> binding.handle = fc.register_forward_hook(binding.torch_hook)
        >>> remember_binding(binding)
        >>> hook(fc, (), torch.ones(1))  # called directly, it runs as that binding
        tensor([0.])
        >>> binding.remove()
    """
    _LAST_BINDING[binding.hook] = binding
