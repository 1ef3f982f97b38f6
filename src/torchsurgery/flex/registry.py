"""The hooks one FlexModel put on its model: their bindings, their groups, their undo record.

A :class:`~torchsurgery.flex.hook_function.HookFunction` is bound to every module (or
parameter) its name matches, each binding a PyTorch hook running the wrapper's
:class:`~torchsurgery.flex.runtime.HookRuntime`. The bindings stay for the wrapper's
lifetime; groups only choose which of them run in a forward. The :class:`HookRegistry`
also holds the wrapper's :class:`~torchsurgery.flex.record.FlexRecord` on the model's undo
log: while it is there the wrapper is alive, and undoing it takes every hook off.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._names import no_match
from torchsurgery.flex.compiled import invalidate_compiled
from torchsurgery.flex.groups import ALL, HookGroups, name_matches
from torchsurgery.flex.hook_function import (
    HOOK_TYPES,
    Binding,
    EditingFunction,
    HookFunction,
    HookType,
    remember_binding,
)
from torchsurgery.flex.record import FlexRecord, finalize, remove_bindings
from torchsurgery.flex.runtime import HookRuntime, make_torch_hook
from torchsurgery.flex.targets import find_targets, unwrap

__all__ = ["HookRegistry", "HookMethods"]

_WHAT = "torchsurgery.FlexModel"


class HookRegistry:
    """The hooks of one wrapper on ``module``, grouped, and the record that undoes them.

    Holds no reference to the wrapper, so a dropped wrapper can be collected (and its
    hooks taken off by :meth:`finalizer`).

    Attributes:
        module: the wrapped model.
        runtime: what the hooks run.
        bindings: one per (hook function, module or parameter), in registration order.
        groups: the groups of the registered hook functions.
        record: the wrapper's entry on ``module``'s undo log.

    Example:
        >>> from torchsurgery.flex.captures import Captures
        >>> from torchsurgery.flex.routing import LocalRouting
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> out = {}
        >>> registry = HookRegistry(model, HookRuntime(Captures(out), LocalRouting()))
        >>> _undo.push(model, registry.record)
        >>> registry.register(HookFunction("0"), "forward")
        >>> _ = model(torch.ones(1, 2)); list(out)
        ['0']
        >>> registry.restore(); len(model[0]._forward_hooks)
        0
    """

    def __init__(self, module: nn.Module, runtime: HookRuntime) -> None:
        self.module = module
        self.runtime = runtime
        self.bindings: list[Binding] = []
        self.groups = HookGroups()
        self.record = FlexRecord(self.bindings, runtime.routing)

    def finalizer(self, owner: object) -> weakref.finalize[Any, Any]:
        """Undo the record (or take the hooks off, model gone) when ``owner`` is collected."""
        return weakref.finalize(owner, finalize, weakref.ref(self.module), self.record)

    def check_alive(self, what: str) -> None:
        """Refuse ``what`` once the record was undone (the wrapper restored).

        Raises:
            RuntimeError: the wrapper was restored.
        """
        if self.record not in _undo.records(self.module):
            raise RuntimeError(f"{_WHAT}.{what}: this wrapper was restored; wrap the model again")

    def restore(self) -> None:
        """Undo the record if it is still on the model's log: every hook comes off."""
        if self.record in _undo.records(self.module):
            _undo.check_idle(self.module, f"{_WHAT}.restore")
            self.record.undo(self.module)

    def register(self, hook: HookFunction, hook_type: HookType, *, local: bool = False) -> None:
        """Bind ``hook`` to every module (or parameter) it names, as a ``hook_type`` hook.

        ``local``: the names were matched on this process's modules already (a pipeline
        stage does not ask the others whether they exist).

        Raises:
            TypeError: ``hook`` is not a HookFunction.
            ValueError: it is registered as a ``hook_type`` hook already, or names nothing.
        """
        self.check_alive(f"register ({hook_type})")
        _undo.check_idle(self.module, _WHAT)  # hook dicts change size while iterated
        if not isinstance(hook, HookFunction):
            raise TypeError(f"{_WHAT}: expected a HookFunction, got {type(hook).__name__}")
        if any(b.hook is hook and b.hook_type == hook_type for b in self.bindings):
            raise ValueError(f"{_WHAT}: {hook!r} is already registered as a {hook_type} hook")
        targets = find_targets(self.module, hook.module_name, hook_type, self.runtime.routing, local=local)
        added: list[Binding] = []
        try:
            for name, target, owner in targets:
                taken = sum(1 for b in self.bindings if b.name == name)
                binding = Binding(hook, hook_type, name, name if taken == 0 else f"{name}#{taken + 1}")
                binding.torch_hook = make_torch_hook(binding, self.runtime, owner)
                binding.handle = _attach(target, binding)
                self.bindings.append(binding)
                added.append(binding)
        except BaseException:
            for binding in added:
                self.bindings.remove(binding)
            remove_bindings(added)
            raise
        self.groups.register(hook)
        if added:
            remember_binding(added[0])
        invalidate_compiled(self.module)

    def create_group(
        self,
        group_name: str,
        group_constructor: str | HookFunction | Iterable[HookFunction],
        hook_type: str,
        *,
        expected_shape: Sequence[int | None] | None,
        editing_function: EditingFunction | None,
        unpack_idx: int,
    ) -> list[HookFunction]:
        """``FlexModel.create_hook_group``: the hooks made or given, registered and grouped."""
        what = f"{_WHAT}.create_hook_group"
        if not isinstance(group_name, str) or group_name == ALL:
            raise ValueError(
                f"{what}: group_name must be a string other than 'all' (the built-in group every hook "
                f"is in), got {group_name!r}; choose another name"
            )
        if hook_type not in HOOK_TYPES:
            raise ValueError(f"{what}: hook_type must be one of {HOOK_TYPES}, got {hook_type!r}")
        if isinstance(group_constructor, str):
            hooks = [
                HookFunction(name, expected_shape, editing_function, unpack_idx)
                for name in self._matching(group_constructor, hook_type, what)
            ]
            # pipeline stages match different names: no stage-wide check per created hook
            for hook in hooks:
                self.register(hook, hook_type, local=True)
        else:
            hooks = _given(group_constructor, what)
        registered = {b.hook for b in self.bindings}
        for hook in hooks:
            if hook not in registered:
                self.register(hook, hook_type)
        self.groups.add(hooks, group_name, what)
        return hooks

    def _matching(self, pattern: str, hook_type: HookType, what: str) -> list[str]:
        """The module (or, for tensor hooks, parameter) names ``pattern`` matches here.

        Raises:
            ValueError: it matches nothing on any process (near names listed).
        """
        root = unwrap(self.module)
        names = (
            [n for n, _ in root.named_parameters()]
            if hook_type == "tensor"
            else [n for n, _ in root.named_modules() if n]
        )
        matched = [n for n in names if name_matches(pattern, n)]
        if not self.runtime.routing.matched_anywhere(bool(matched), hook_type, pattern):
            raise no_match(what, pattern, names)
        return matched


class HookMethods(nn.Module):
    """flex_model's hook and group methods of a FlexModel, served by its :class:`HookRegistry`.

    Example:
        >>> import torchsurgery
        >>> flex = torchsurgery.FlexModel(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), {})
        >>> hooks = flex.create_hook_group("linear", "0")
        >>> flex.register_forward_hook(torchsurgery.HookFunction("1"))
        >>> [h.module_name for h in flex.get_group_hook_functions("all")], flex.get_hook_function_groups(hooks[0]) == {"all", "linear"}
        (['0', '1'], True)
    """

    _hooks: HookRegistry

    def register_forward_hook(self, hook_function: HookFunction) -> None:  # type: ignore[override]
        """Capture/edit the output of ``hook_function.module_name`` (a name or glob)."""
        self._hooks.register(hook_function, "forward")

    def register_forward_pre_hook(self, hook_function: HookFunction) -> None:  # type: ignore[override]
        """Capture/edit the inputs (positional and keyword, flattened in that order)."""
        self._hooks.register(hook_function, "forward_pre")

    def register_full_backward_hook(self, hook_function: HookFunction) -> None:  # type: ignore[override]
        """Capture/edit the gradient with respect to the module's inputs."""
        self._hooks.register(hook_function, "full_backward")

    def register_full_backward_pre_hook(self, hook_function: HookFunction) -> None:  # type: ignore[override]
        """Capture/edit the gradient with respect to the module's outputs."""
        self._hooks.register(hook_function, "full_backward_pre")

    def register_hook(self, hook_function: HookFunction) -> None:
        """Capture/edit the gradient of the *parameter* ``hook_function.module_name``."""
        self._hooks.register(hook_function, "tensor")

    def create_hook_group(
        self,
        group_name: str,
        group_constructor: str | HookFunction | Iterable[HookFunction],
        expected_shape: Sequence[int | None] | None = None,
        editing_function: EditingFunction | None = None,
        unpack_idx: int = 0,
        hook_type: str = "forward",
    ) -> list[HookFunction]:
        """Create hooks and put them in a group.

        Args:
            group_name: the group.
            group_constructor: a string matched against module names (parameter names for
                ``hook_type="tensor"``): a substring, as in flex_model, or a glob; or
                HookFunctions (registered now if they are not yet).
            expected_shape: for hooks created from a string.
            editing_function: for hooks created from a string.
            unpack_idx: for hooks created from a string.
            hook_type: one of ``forward``, ``forward_pre``, ``full_backward``,
                ``full_backward_pre``, ``tensor``.

        Returns:
            The hook functions of the group that this call created or registered.

        Raises:
            ValueError: the string matches nothing (near matches listed), or a bad hook type.
        """
        return self._hooks.create_group(
            group_name, group_constructor, hook_type,
            expected_shape=expected_shape, editing_function=editing_function, unpack_idx=unpack_idx,
        )

    def update_hook_groups(self, group_constructor: str | HookFunction | Iterable[HookFunction], group_name: str) -> None:
        """Add registered hook functions (given, or matched by module name) to ``group_name``."""
        what = "torchsurgery.FlexModel.update_hook_groups"
        self._hooks.groups.add(self._hooks.groups.select(group_constructor, what), group_name, what)

    def remove_hook_groups(self, group_constructor: str | HookFunction | Iterable[HookFunction], group_name: str) -> None:
        """Take hook functions (given, or matched by module name) out of ``group_name``."""
        what = "torchsurgery.FlexModel.remove_hook_groups"
        self._hooks.groups.discard(self._hooks.groups.select(group_constructor, what), group_name, what)

    def get_group_hook_functions(self, group_name: str) -> list[HookFunction]:
        """The hook functions in ``group_name``."""
        return self._hooks.groups.members(group_name)

    def get_hook_function_groups(self, hook_function: HookFunction) -> set[str]:
        """The groups ``hook_function`` belongs to."""
        if not isinstance(hook_function, HookFunction):
            raise TypeError(
                f"torchsurgery.FlexModel.get_hook_function_groups: expected a HookFunction, got {hook_function!r}"
            )
        return self._hooks.groups.groups_of(hook_function)



def _given(constructor: HookFunction | Iterable[HookFunction], what: str) -> list[HookFunction]:
    """The hook functions a group constructor that is not a name pattern holds."""
    if isinstance(constructor, HookFunction):
        return [constructor]
    hooks = list(constructor) if isinstance(constructor, Iterable) else [constructor]
    if not all(isinstance(h, HookFunction) for h in hooks):
        raise TypeError(
            f"{what}: group_constructor must be a module-name pattern, a HookFunction or several, "
            f"got {constructor!r}"
        )
    return hooks


def _attach(target: nn.Module | torch.Tensor, binding: Binding) -> torch.utils.hooks.RemovableHandle:
    """Register ``binding``'s torch hook on ``target`` as its hook type says."""
    fn: Any = binding.torch_hook  # typed per hook kind by torch
    if isinstance(target, torch.Tensor):
        return target.register_hook(fn)
    if binding.hook_type == "forward":
        return target.register_forward_hook(fn)
    if binding.hook_type == "forward_pre":
        return target.register_forward_pre_hook(fn, with_kwargs=True)
    if binding.hook_type == "full_backward":
        return target.register_full_backward_hook(fn)
    return target.register_full_backward_pre_hook(fn)
