"""The hook runtime: what runs when PyTorch calls a bound HookFunction.

The torch hook (one small object per :class:`~torchsurgery.flex.hook_function.Binding`)
hands the module's output, inputs or gradients to :meth:`HookRuntime.run`, which takes
the chosen tensor out of the (nested) structure, lets the wrapper's
:class:`~torchsurgery.flex.routing.Routing` capture and edit it, and puts the result
back in the same structure.

The torch hooks are objects, not closures: a deep copy or a pickle of the model then
carries hooks bound to the copy's own bindings and runtime (its own ``output_ptr``).
"""

from __future__ import annotations

import functools
from argparse import Namespace
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchsurgery.flex.captures import Captures
from torchsurgery.flex.hook_function import Binding, HookFunction
from torchsurgery.flex.pytree import flatten
from torchsurgery.flex.routing import Routing

__all__ = ["HookRuntime", "make_torch_hook"]


class HookRuntime:
    """State the hooks of one wrapper share. Holds no reference to the wrapper, so the
    wrapper can be collected while the model still holds its hooks.

    Attributes:
        captures: where captures go.
        routing: how activations travel (one process or several ranks).
        save_ctx: the namespace every editing function gets, kept across hooks and forwards.
        trainable_modules: the modules every editing function gets.

    Example:
        >>> from torchsurgery.flex.hook_function import HookFunction
        >>> from torchsurgery.flex.routing import LocalRouting
        >>> out = {}
        >>> runtime = HookRuntime(Captures(out), LocalRouting())
        >>> hook = HookFunction("fc", editing_function=lambda m, x, ctx, mods: -x)
        >>> runtime.run(Binding(hook, "forward", "fc", "fc"), None, (torch.ones(1), "kept"))
        (tensor([-1.]), 'kept')
        >>> out["fc"]
        [tensor([1.])]
    """

    def __init__(self, captures: Captures, routing: Routing) -> None:
        self.captures = captures
        self.routing = routing
        self.save_ctx = Namespace()
        self.trainable_modules = nn.ModuleDict()

    def forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], active: set[HookFunction] | None
    ) -> Any:
        """Run ``module`` (through the routing) with only the ``active`` hooks on (``None``: all).

        The captures of this call reach ``output_ptr`` together when it returns; those of a
        failed call are dropped (other threads' are untouched) and the error propagates.
        """
        captures, routing = self.captures, self.routing
        call, token = captures.begin(active)
        try:
            outputs = routing.forward(module, args, kwargs)
        except BaseException:
            routing.end_forward(captures, failed=True)
            raise
        finally:
            captures.end(call, token)
        captures.publish(call)
        routing.end_forward(captures)
        return outputs

    def add_trainable(self, name: str, module: nn.Module) -> None:
        """Give every editing function ``module`` as ``modules[name]``.

        Raises:
            TypeError: ``module`` is not a module.
            ValueError: ``name`` is empty, not a string or holds a ``.``.
        """
        what = "torchsurgery.FlexModel.register_trainable_module"
        if not isinstance(module, nn.Module):
            raise TypeError(f"{what}: expected an nn.Module, got {module!r}")
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(
                f"{what}: the name is the key editing functions read (modules[name]) and must be a "
                f"non-empty string without '.', got {name!r}; e.g. {str(name).replace('.', '_') or 'probe'!r}"
            )
        self.routing.prepare_trainable(module)
        self.trainable_modules[name] = module

    def run(self, binding: Binding, module: nn.Module | None, obj: Any) -> Any:
        """Capture and edit the chosen tensor of ``obj``; ``None`` when nothing changed."""
        if torch.compiler.is_compiling():
            # Traced, the group choice would be frozen into the graph: run outside it, so the
            # choice is made on every call (and captures happen as in eager mode).
            # (made where it is traced: it runs only under the compiler, which is then imported; a
            # function kept in a global would be a guard, one in a cache a warning, on every user's compile)
            return torch.compiler.disable(HookRuntime._run, recursive=True)(self, binding, module, obj)
        return self._run(binding, module, obj)

    def _run(self, binding: Binding, module: nn.Module | None, obj: Any) -> Any:
        hook = binding.hook
        if not self.captures.runs(hook):
            return None
        leaves, rebuild = flatten(obj)
        if not leaves:
            return None  # e.g. no input gradient: nothing to capture or edit
        if hook.unpack_idx >= len(leaves):
            raise IndexError(
                f"torchsurgery.FlexModel: hook on {binding.name!r} has unpack_idx={hook.unpack_idx}, "
                f"but the {binding.hook_type} value holds only {len(leaves)} tensor(s)"
            )
        local = leaves[hook.unpack_idx]
        edit = functools.partial(self.edit, binding, module) if hook.edits else None
        new_local = self.routing.route(binding, module, local, edit, self.captures)
        if new_local is None:
            return None
        new_leaves = list(leaves)
        new_leaves[hook.unpack_idx] = new_local
        return rebuild(new_leaves)

    def edit(self, binding: Binding, module: nn.Module | None, full: torch.Tensor) -> torch.Tensor:
        """Run the editing function of ``binding`` on the full tensor and check its result."""
        edited = binding.hook.editing_function(module, full, self.save_ctx, self.trainable_modules)  # type: ignore[arg-type]
        if not isinstance(edited, torch.Tensor):
            raise TypeError(
                f"torchsurgery.FlexModel: the editing function of the hook on {binding.name!r} returned "
                f"{type(edited).__name__}; it must return a Tensor"
            )
        if edited.shape != full.shape and not binding.hook.allow_shape_change:
            raise ValueError(
                f"torchsurgery.FlexModel: the editing function of the hook on {binding.name!r} changed the "
                f"shape from {list(full.shape)} to {list(edited.shape)}; return the same shape, or create "
                "the HookFunction with allow_shape_change=True"
            )
        return edited




class _TorchHook:
    __slots__ = ("binding", "runtime")

    def __init__(self, binding: Binding, runtime: HookRuntime) -> None:
        self.binding = binding
        self.runtime = runtime


class _ForwardHook(_TorchHook):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        return self.runtime.run(self.binding, module, output)


class _ForwardPreHook(_TorchHook):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        # args and kwargs together, so keyword inputs (hidden_states=...) are reachable
        return self.runtime.run(self.binding, module, (args, kwargs))


class _BackwardHook(_TorchHook):
    __slots__ = ()

    def __call__(self, module: nn.Module, grads: Any, *_: Any) -> Any:
        return self.runtime.run(self.binding, module, grads)


class _TensorHook(_TorchHook):
    __slots__ = ("owner",)

    def __init__(self, binding: Binding, runtime: HookRuntime, owner: nn.Module | None) -> None:
        super().__init__(binding, runtime)
        self.owner = owner

    def __call__(self, grad: torch.Tensor) -> Any:
        return self.runtime.run(self.binding, self.owner, grad)


def make_torch_hook(binding: Binding, runtime: HookRuntime, owner: nn.Module | None) -> Callable[..., Any]:
    """The callable PyTorch runs for ``binding`` (``owner``: a tensor hook's module).

    Example:
        >>> from torchsurgery.flex.hook_function import HookFunction
        >>> from torchsurgery.flex.routing import LocalRouting
        >>> out = {}
        >>> runtime = HookRuntime(Captures(out), LocalRouting())
        >>> fc = nn.Linear(2, 2)
        >>> handle = fc.register_forward_hook(make_torch_hook(Binding(HookFunction("fc"), "forward", "fc", "fc"), runtime, None))
        >>> _ = fc(torch.ones(1, 2)); handle.remove()
        >>> list(out)
        ['fc']
    """
    if binding.hook_type == "forward":
        return _ForwardHook(binding, runtime)
    if binding.hook_type == "forward_pre":
        return _ForwardPreHook(binding, runtime)
    if binding.hook_type in ("full_backward", "full_backward_pre"):
        return _BackwardHook(binding, runtime)
    return _TensorHook(binding, runtime, owner)
