"""``FlexModel``: capture and edit activations of any model by module name, in groups.

The API is flex_model 0.1.0's (same names, signatures and ``output_ptr`` layout), so
its users switch by changing an import; its known bugs are fixed, and it runs without
any process group in a single process.

How it works: each registered :class:`~torchsurgery.HookFunction` is bound to the
module(s) it names with PyTorch's own hooks. The hook takes the chosen tensor out of
the module's (nested) output or input, asks the :class:`~torchsurgery.flex.routing.Routing`
for the full tensor, appends a CPU copy to ``output_ptr[key]`` (captured *before* the
edit), runs the editing function, and puts the result back in the same structure.
Hooks stay registered for the wrapper's lifetime; a forward's ``groups`` only switch
them on and off, so hook order never changes and nothing is re-registered per call.

In distributed runs (parallel sizes above 1, a process group or a device mesh) the
routing is the one registered with :func:`~torchsurgery.flex.routing.register_parallel_routing`
(``torchsurgery`` registers :class:`torchsurgery.distributed.DistributedRouting`): editing functions see
whole tensors (tensor-parallel shards gathered, data-parallel batches assembled), the
model gets its local part back, captures reach every rank (as in flex_model; or the first
rank alone, with ``captures_on="first_rank"``), and with pipeline parallelism the wrapper
runs this rank's stage and passes activations on.

The wrapper shares the wrapped model's parameter, buffer and child dictionaries, so
``parameters()``, ``to()``, ``train()`` and friends act on the wrapped model with its own
names; ``state_dict()`` is flex_model's: the model under ``module.`` and the trainable
modules under ``trainable_modules.``, so a saved wrapper keeps what its hooks trained. :meth:`FlexModel.restore` (or ``torchsurgery.restore(model)``,
or dropping the wrapper) removes every hook and leaves the model exactly as it was.
"""

from __future__ import annotations

import copy
import weakref
from argparse import Namespace
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._names import no_match
from torchsurgery.flex.captures import Captures, OutputPtr
from torchsurgery.flex.compiled import invalidate_compiled
from torchsurgery.flex.groups import HookGroups, name_matches
from torchsurgery.flex.hook_function import (
    HOOK_TYPES,
    Binding,
    EditingFunction,
    HookFunction,
    HookType,
    remember_binding,
    shape_hint,
)
from torchsurgery.flex.parallel import CapturesOn, ParallelRequest
from torchsurgery.flex.record import FlexRecord, finalize, remove_bindings
from torchsurgery.flex.routing import routing_for
from torchsurgery.flex.runtime import HookRuntime, make_torch_hook
from torchsurgery.flex.targets import find_targets, split_prefix, unwrap, unwrap_with_prefixes

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FlexModel"]


class FlexModel(nn.Module):
    """Wrap a model to capture and edit activations of its submodules by name.

    Same constructor and methods as ``flex_model.core.FlexModel``. Captured activations
    go to ``output_ptr[module_name]`` as CPU tensors, one appended per forward, captured
    before the hook's edit. When a module carries several hooks, the first keeps the
    key ``module_name`` and the next ones get ``module_name#2``, ``module_name#3``...

    Args:
        module: the model to wrap (not copied).
        output_ptr: the dict captures are appended to.
        tensor_parallel_size: ranks per tensor-parallel group; ranks are laid out as in
            Megatron-LM (tensor-parallel ranks contiguous, then data-parallel, then
            pipeline stages).
        pipeline_parallel_size: pipeline stages. ``module`` is then this rank's stage:
            the first stage gets ``forward``'s arguments, each later stage the tensors
            the previous one returned; the last stage's ranks return the output, the
            others ``None``; :meth:`backward` runs the backward through every stage.
            Hooks may name modules another stage holds.
        data_parallel_size: data-parallel replicas, each with its own batch (sizes may
            differ). ``module`` may be wrapped in DDP or sharded with FSDP2; hooks name
            modules as the bare model does (``fc1``) or as DDP does (``module.fc1``).
            Gradient hooks see the gradient of the mean of the replicas' losses, the
            loss DDP optimizes.
        process_group: lay out only this group's ranks (default: the whole world).
        device_mesh: a ``DeviceMesh`` whose dimensions are named among ``pp``, ``dp``,
            ``tp``; it gives the sizes and the rank order.
        captures_on: across ranks, ``"every_rank"`` (default, as flex_model): every rank's
            ``output_ptr`` receives the same captures, every replica's rows and every
            stage's hooks; ``"first_rank"``: only the layout's first rank's (global rank 0
            by default), which saves the memory and traffic of the copies.

    Across ranks: ``output_ptr`` is filled at the end of each forward (and each backward,
    for gradient hooks) on the ranks ``captures_on`` names; ``save_ctx`` is each rank's
    own; trainable modules are copied from rank 0 when registered and their gradients are
    summed over the tensor-parallel ranks of a stage and averaged over the replicas, so
    every rank holds the gradient one process would compute.

    Captures of one forward reach ``output_ptr`` together when it returns; the group choice
    and the captures belong to the call, so threads may share a wrapper.

    Raises:
        TypeError: ``module`` is not a module or ``output_ptr`` not a dict.
        ValueError: a parallel size is not a positive integer, the sizes do not
            multiply to the number of ranks (the numbers are named), or ``captures_on``
            is neither ``"every_rank"`` nor ``"first_rank"``.
        RuntimeError: parallel sizes were given but no process group exists (and this
            is not a torchrun launch), or torch was built without distributed support.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> out = {}
        >>> flex = torchsurgery.FlexModel(model, out)
        >>> flex.register_forward_hook(torchsurgery.HookFunction("*"))  # every child
        >>> _ = flex(torch.randn(2, 3))
        >>> sorted(out), out["1"][0].shape
        (['0', '1', '2'], torch.Size([2, 4]))
        >>> flex.restore() is model, len(model[0]._forward_hooks)
        (True, 0)
    """

    def __init__(
        self,
        module: nn.Module,
        output_ptr: OutputPtr,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        process_group: ProcessGroup | None = None,
        *,
        device_mesh: DeviceMesh | None = None,
        captures_on: CapturesOn = "every_rank",
    ) -> None:
        what = "torchsurgery.FlexModel"
        if not isinstance(module, nn.Module):
            raise TypeError(f"{what}: expected an nn.Module to wrap, got {type(module).__name__}")
        if isinstance(module, FlexModel):
            raise TypeError(f"{what}: the model is already a FlexModel; wrap the model it holds (flex.module)")
        if not isinstance(output_ptr, dict):
            raise TypeError(f"{what}: output_ptr must be a dict, got {type(output_ptr).__name__}")
        request = ParallelRequest.of(
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size, process_group=process_group, device_mesh=device_mesh,
            captures_on=captures_on, what=what,
        )
        super().__init__()
        routing = routing_for(request, what)
        runtime = HookRuntime(Captures(output_ptr), routing)
        bindings: list[Binding] = []
        record = FlexRecord(bindings, routing)
        d = self.__dict__
        # Not a child: the wrapper's module surface *is* the wrapped model's (no "module." prefix).
        d["module"] = module
        d["_modules"] = module._modules
        d["_parameters"] = module._parameters
        d["_buffers"] = module._buffers
        d["_non_persistent_buffers_set"] = module._non_persistent_buffers_set
        d["_runtime"] = runtime
        d["_bindings"] = bindings
        d["_groups"] = HookGroups()
        d["_record"] = record
        # a device mesh gives the sizes
        d["tp_size"], d["pp_size"], d["dp_size"] = routing.sizes.tensor, routing.sizes.pipeline, routing.sizes.data
        d["process_group"] = process_group
        self.training = module.training
        _undo.push(module, record)
        d["_finalizer"] = weakref.finalize(self, finalize, weakref.ref(module), record)

    # ------------------------------------------------------------------ state

    @property
    def output_ptr(self) -> OutputPtr:
        """The dict captured activations are appended to."""
        return self._runtime.captures.output_ptr

    @output_ptr.setter
    def output_ptr(self, value: OutputPtr) -> None:
        if not isinstance(value, dict):
            raise TypeError(f"torchsurgery.FlexModel: output_ptr must be a dict, got {type(value).__name__}")
        self._runtime.captures.output_ptr = value

    @property
    def save_ctx(self) -> Namespace:
        """A namespace shared by every editing function, kept across hooks and forwards."""
        return self._runtime.save_ctx

    @property
    def trainable_modules(self) -> nn.ModuleDict:
        """Modules every editing function receives as ``modules``; train them with backward."""
        return self._runtime.trainable_modules

    @property
    def wrapped_module_names(self) -> list[str]:
        """Qualified names of every submodule of the wrapped model."""
        return [name for name, _ in self.module.named_modules()]

    @property
    def trainable_modules_names(self) -> list[str]:
        """Names of the registered trainable modules."""
        return list(self.trainable_modules.keys())

    @property
    def all_modules_names(self) -> list[str]:
        """Wrapped module names followed by trainable module names."""
        return self.wrapped_module_names + self.trainable_modules_names

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # attributes of the wrapped model (config, generate, ...) read through the wrapper
            return getattr(self.__dict__["module"], name)

    # The wrapper's module, parameter and buffer dicts *are* the wrapped model's: a module,
    # parameter or buffer set on the wrapper would land in the model and outlive restore().

    def _refuse(self, what: str, name: str) -> None:
        raise TypeError(
            f"torchsurgery.FlexModel.{what}: {name!r} would become part of the wrapped model "
            "(the wrapper shares its modules, parameters and buffers) and outlive restore(); "
            f"use flex.register_trainable_module({name!r}, module) for a module editing functions "
            "use, or change the model itself through flex.module"
        )

    def _shared_name(self, name: str) -> bool:
        d = self.__dict__
        return name in d["_modules"] or name in d["_parameters"] or name in d["_buffers"]

    def __setattr__(self, name: str, value: Any) -> None:
        if "_runtime" in self.__dict__ and (isinstance(value, (nn.Module, nn.Parameter)) or self._shared_name(name)):
            self._refuse("__setattr__", name)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self._shared_name(name):
            self._refuse("__delattr__", name)
        super().__delattr__(name)

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        """Refused: a buffer on the wrapper would be the wrapped model's (see ``__setattr__``)."""
        self._refuse("register_buffer", name)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """Refused: a parameter on the wrapper would be the wrapped model's."""
        self._refuse("register_parameter", name)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        """Refused: a submodule on the wrapper would be the wrapped model's."""
        self._refuse("add_module", name)

    def register_module(self, name: str, module: nn.Module | None) -> None:
        """Refused: a submodule on the wrapper would be the wrapped model's."""
        self._refuse("register_module", name)

    # --------------------------------------------------------- copies, pickles

    def __deepcopy__(self, memo: dict[int, Any]) -> FlexModel:
        """An independent wrapper around a deep copy of the model: its own hooks, groups,
        ``output_ptr`` (a copy of this one's), ``save_ctx`` and trainable modules."""
        self._check_alive("__deepcopy__")
        new = object.__new__(type(self))
        memo[id(self)] = new
        d = new.__dict__
        for key, value in self.__dict__.items():
            if key != "_finalizer":
                d[key] = copy.deepcopy(value, memo)  # the memo keeps shared objects shared
        d["_finalizer"] = weakref.finalize(new, finalize, weakref.ref(d["module"]), d["_record"])
        return new

    def __getstate__(self) -> dict[str, Any]:
        self._check_alive("__getstate__")
        return {k: v for k, v in self.__dict__.items() if k != "_finalizer"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__["_finalizer"] = weakref.finalize(self, finalize, weakref.ref(self.module), self._record)

    def _check_alive(self, what: str) -> None:
        if self._record not in _undo.records(self.module):
            raise RuntimeError(
                f"torchsurgery.FlexModel.{what}: this wrapper was restored; wrap the model again"
            )

    # ------------------------------------------------------- nn.Module surface

    def _layout(self) -> nn.Module:
        """flex_model's module tree: the model as child ``module``, the trainable modules as
        ``trainable_modules``; what its ``state_dict`` keys are made of. The wrapper itself
        cannot be it: it shares the model's child dict, so the model's children are its own."""
        layout = nn.Module()
        layout.module = self.module
        layout.trainable_modules = self.trainable_modules
        return layout

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model and the trainable modules, under flex_model's keys.

        ``module.<name>`` for each entry of the wrapped model's ``state_dict`` and
        ``trainable_modules.<module>.<name>`` for each trainable module's, as
        ``flex_model.core.FlexModel.state_dict`` has them, so what a program trained through
        its hooks is saved with the model. ``named_parameters()`` keeps the model's own names.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> import torchsurgery
            >>> flex = torchsurgery.FlexModel(nn.Sequential(nn.Linear(2, 2)), {})
            >>> flex.register_trainable_module("steer", nn.Linear(2, 2, bias=False))
            >>> list(flex.state_dict())
            ['module.0.weight', 'module.0.bias', 'trainable_modules.steer.weight']
            >>> flex.load_state_dict(flex.state_dict())
            <All keys matched successfully>
        """
        return self._layout().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a :meth:`state_dict` (ours or flex_model's: the same keys) into the model and
        the trainable modules; register the trainable modules first.

        Raises:
            RuntimeError: with ``strict``, keys are missing or unexpected (named, with the
                fix when the keys are the bare model's).
        """
        try:
            return self._layout().load_state_dict(state_dict, strict=strict, assign=assign)
        except RuntimeError as exc:
            fix = ""
            if state_dict and set(state_dict) <= set(self.module.state_dict()):
                fix = ("; these are the wrapped model's own keys (no 'module.' prefix): load them with "
                       "flex.module.load_state_dict(state_dict)")
            elif any(key.startswith("trainable_modules.") for key in state_dict):
                fix = "; register each trainable module (flex.register_trainable_module) before loading"
            raise RuntimeError(f"torchsurgery.FlexModel.load_state_dict: {str(exc).strip()}{fix}") from None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FlexModel:
        self.module._apply(fn, recurse)
        self.trainable_modules._apply(fn, recurse)
        return self

    def train(self, mode: bool = True) -> FlexModel:
        """Set training mode on the wrapped model and the trainable modules."""
        self.module.train(mode)
        self.trainable_modules.train(mode)
        self.training = mode
        return self

    # -------------------------------------------------------------- forward

    def forward(self, *args: Any, groups: str | Sequence[str] = "all", complement: bool = False, **kwargs: Any) -> Any:
        """Run the wrapped model with the hooks of ``groups`` active (all others off).

        Args:
            *args: passed to the wrapped model.
            groups: a group name or several; ``"all"`` runs every hook.
            complement: run the hooks *not* in ``groups`` instead.
            **kwargs: passed to the wrapped model.

        Returns:
            The wrapped model's output (with any edits applied).

        Raises:
            ValueError: an unknown group name. Exceptions from the model or an editing
                function propagate unchanged; the captures of the failed forward are
                dropped and the wrapper stays usable.
        """
        self._check_alive("forward")
        runtime = self._runtime
        everything = not complement and (groups == "all" or groups == ["all"] or groups == ("all",))
        active = None if everything else self._groups.active(groups, complement, "torchsurgery.FlexModel.forward")
        captures, routing = runtime.captures, runtime.routing
        call, token = captures.begin(active)
        try:
            outputs = routing.forward(self.module, args, kwargs)
        except BaseException:
            # this forward's captures are dropped; other threads' are untouched
            routing.end_forward(captures, failed=True)
            raise
        finally:
            captures.end(call, token)
        captures.publish(call)
        routing.end_forward(captures)
        return outputs

    def backward(self, loss: torch.Tensor | None = None) -> None:
        """Run the backward of ``loss``, through every pipeline stage when there are several.

        In one process, and with tensor or data parallelism, this is ``loss.backward()``.
        With pipeline stages, call it on every rank after the forward: with the loss on the
        last stage's ranks and ``None`` on the others, which go on from the gradients the
        next stage sends back. Gradient hooks then run on every stage and their captures
        reach ``output_ptr`` when it returns.

        Raises:
            TypeError: no loss tensor where one is needed (one process, or the last stage).
            RuntimeError: another rank's backward failed (pipeline stages).
        """
        self._check_alive("backward")
        self._runtime.routing.backward(self._runtime.captures, loss)

    # --------------------------------------------------------- registration

    def _register(self, hook: HookFunction, hook_type: HookType, *, local: bool = False) -> None:
        self._check_alive(f"register ({hook_type})")
        _undo.check_idle(self.module, "torchsurgery.FlexModel")  # hook dicts change size while iterated
        if not isinstance(hook, HookFunction):
            raise TypeError(f"torchsurgery.FlexModel: expected a HookFunction, got {type(hook).__name__}")
        if any(b.hook is hook and b.hook_type == hook_type for b in self._bindings):
            raise ValueError(f"torchsurgery.FlexModel: {hook!r} is already registered as a {hook_type} hook")
        targets = find_targets(self.module, hook.module_name, hook_type, self._runtime.routing, local=local)
        added: list[Binding] = []
        try:
            for name, target, owner in targets:
                taken = sum(1 for b in self._bindings if b.name == name)
                binding = Binding(hook, hook_type, name, name if taken == 0 else f"{name}#{taken + 1}")
                binding.torch_hook = make_torch_hook(binding, self._runtime, owner)
                binding.handle = _attach(target, binding)
                self._bindings.append(binding)
                added.append(binding)
        except BaseException:
            for binding in added:
                self._bindings.remove(binding)
            remove_bindings(added)
            raise
        self._groups.register(hook)
        if added:
            remember_binding(added[0])
        invalidate_compiled(self.module)

    def register_forward_hook(self, hook_function: HookFunction) -> None:  # type: ignore[override]
        """Capture/edit the output of ``hook_function.module_name`` (a name or glob)."""
        self._register(hook_function, "forward")

    def register_forward_pre_hook(self, hook_function: HookFunction) -> None:  # type: ignore[override]
        """Capture/edit the inputs (positional and keyword, flattened in that order)."""
        self._register(hook_function, "forward_pre")

    def register_full_backward_hook(self, hook_function: HookFunction) -> None:  # type: ignore[override]
        """Capture/edit the gradient with respect to the module's inputs."""
        self._register(hook_function, "full_backward")

    def register_full_backward_pre_hook(self, hook_function: HookFunction) -> None:  # type: ignore[override]
        """Capture/edit the gradient with respect to the module's outputs."""
        self._register(hook_function, "full_backward_pre")

    def register_hook(self, hook_function: HookFunction) -> None:
        """Capture/edit the gradient of the *parameter* ``hook_function.module_name``."""
        self._register(hook_function, "tensor")

    def register_trainable_module(self, name: str, module: nn.Module) -> None:
        """Expose ``module`` to every editing function as ``modules[name]``."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"torchsurgery.FlexModel.register_trainable_module: expected an nn.Module, got {module!r}")
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(
                f"torchsurgery.FlexModel.register_trainable_module: the name is the key editing functions "
                f"read (modules[name]) and must be a non-empty string without '.', got {name!r}; "
                f"e.g. {str(name).replace('.', '_') or 'probe'!r}"
            )
        self._runtime.routing.prepare_trainable(module)
        self.trainable_modules[name] = module

    # ---------------------------------------------------------------- groups

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
        what = "torchsurgery.FlexModel.create_hook_group"
        if not isinstance(group_name, str) or group_name == "all":
            raise ValueError(
                f"{what}: group_name must be a string other than 'all' (the built-in group every hook "
                f"is in), got {group_name!r}; choose another name"
            )
        if hook_type not in HOOK_TYPES:
            raise ValueError(f"{what}: hook_type must be one of {HOOK_TYPES}, got {hook_type!r}")
        if isinstance(group_constructor, str):
            root = unwrap(self.module)
            names = (
                [n for n, _ in root.named_parameters()]
                if hook_type == "tensor"
                else [n for n, _ in root.named_modules() if n]
            )
            matched = [n for n in names if name_matches(group_constructor, n)]
            if not self._runtime.routing.matched_anywhere(bool(matched), hook_type, group_constructor):
                raise no_match(what, group_constructor, names)
            hooks = [HookFunction(n, expected_shape, editing_function, unpack_idx) for n in matched]
            # pipeline stages match different names: no stage-wide check per created hook
            for hook in hooks:
                self._register(hook, hook_type, local=True)
        elif isinstance(group_constructor, HookFunction):
            hooks = [group_constructor]
        else:
            hooks = list(group_constructor) if isinstance(group_constructor, Iterable) else [group_constructor]
            if not all(isinstance(h, HookFunction) for h in hooks):
                raise TypeError(
                    f"{what}: group_constructor must be a module-name pattern, a HookFunction or several, "
                    f"got {group_constructor!r}"
                )
        registered = {b.hook for b in self._bindings}
        for hook in hooks:
            if hook not in registered:
                self._register(hook, hook_type)
        self._groups.add(hooks, group_name, what)
        return hooks

    def update_hook_groups(self, group_constructor: str | HookFunction | Iterable[HookFunction], group_name: str) -> None:
        """Add registered hook functions (given, or matched by module name) to ``group_name``."""
        what = "torchsurgery.FlexModel.update_hook_groups"
        self._groups.add(self._groups.select(group_constructor, what), group_name, what)

    def remove_hook_groups(self, group_constructor: str | HookFunction | Iterable[HookFunction], group_name: str) -> None:
        """Take hook functions (given, or matched by module name) out of ``group_name``."""
        what = "torchsurgery.FlexModel.remove_hook_groups"
        self._groups.discard(self._groups.select(group_constructor, what), group_name, what)

    def get_group_hook_functions(self, group_name: str) -> list[HookFunction]:
        """The hook functions in ``group_name``."""
        return self._groups.members(group_name)

    def get_hook_function_groups(self, hook_function: HookFunction) -> set[str]:
        """The groups ``hook_function`` belongs to."""
        if not isinstance(hook_function, HookFunction):
            raise TypeError(
                f"torchsurgery.FlexModel.get_hook_function_groups: expected a HookFunction, got {hook_function!r}"
            )
        return self._groups.groups_of(hook_function)

    # ------------------------------------------------------------ parameters

    def get_module_parameter(self, parameter_name: str, expected_shape: Sequence[int | None] | None = None) -> torch.Tensor:
        """A detached CPU copy of a wrapped-model parameter, unsharded in distributed runs.

        Raises:
            ValueError: unknown parameter (near names listed) or a shape mismatch.
        """
        what = "torchsurgery.FlexModel.get_module_parameter"
        if not isinstance(parameter_name, str):
            raise TypeError(f"{what}: expected a parameter name such as 'fc1.weight', got {parameter_name!r}")
        root, prefixes = unwrap_with_prefixes(self.module)
        params = dict(root.named_parameters())
        parameter_name = split_prefix(parameter_name, prefixes)[1]
        if parameter_name not in params:
            advice = "with pipeline parallelism, ask on the ranks of the stage that holds it" if self.pp_size > 1 else ""
            raise no_match(what, parameter_name, list(params), kind="parameter", advice=advice)
        local = params[parameter_name].detach()
        shape = shape_hint(expected_shape, what)
        return self._runtime.routing.gather_parameter(local, parameter_name, shape).to("cpu", copy=True)

    # --------------------------------------------------------------- restore

    def restore(self) -> nn.Module:
        """Remove every hook and return the wrapped model, exactly as it was wrapped.

        Works whatever groups were active or whether a forward failed; afterwards this
        wrapper can no longer be used.
        """
        if self._record in _undo.records(self.module):
            _undo.check_idle(self.module, "torchsurgery.FlexModel.restore")
            self._record.undo(self.module)
        self._finalizer.detach()
        return self.module


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
