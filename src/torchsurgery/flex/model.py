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
routing is :class:`torchsurgery.distributed.DistributedRouting`: editing functions see
whole tensors (tensor-parallel shards gathered, data-parallel batches assembled), the
model gets its local part back, captures reach rank 0 alone, and with pipeline
parallelism the wrapper runs this rank's stage and passes activations on.

The wrapper shares the wrapped model's parameter, buffer and child dictionaries, so
``state_dict()``, ``parameters()``, ``to()``, ``train()`` and friends act on the wrapped
model with its own names. :meth:`FlexModel.restore` (or ``torchsurgery.restore(model)``,
or dropping the wrapper) removes every hook and leaves the model exactly as it was.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import sys
import threading
import weakref
from argparse import Namespace
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from torchsurgery import _undo
from torchsurgery._names import glob_match, is_glob, no_match
from torchsurgery.flex._pytree import flatten
from torchsurgery.flex.groups import HookGroups, name_matches
from torchsurgery.flex.hook_function import EditingFunction, HookFunction
from torchsurgery.flex.routing import LocalRouting, Routing

__all__ = ["FlexModel"]

HOOK_TYPES = ("forward", "forward_pre", "full_backward", "full_backward_pre", "tensor")
OutputPtr = dict[str, list[torch.Tensor]]


@dataclass(eq=False)
class _Binding:
    """One hook function bound to one module (or parameter) of one wrapper."""

    hook: HookFunction
    hook_type: str
    name: str
    key: str
    handle: RemovableHandle | None = None


class _Call:
    """What belongs to one forward through the wrapper: its group choice and its captures.

    Kept in a context variable, so concurrent forwards (threads, async tasks) on one
    wrapper each see their own hooks and captures.
    """

    __slots__ = ("active", "captures", "pending_copies")

    def __init__(self, active: set[HookFunction] | None) -> None:
        self.active = active  # None: every hook
        self.captures: OutputPtr = {}
        self.pending_copies = False


class _Runtime:
    """State the hooks share. Holds no reference to the FlexModel, so it can be collected."""

    def __init__(self, output_ptr: OutputPtr, routing: Routing) -> None:
        self.output_ptr = output_ptr
        self.routing = routing
        self.save_ctx = Namespace()
        self.trainable_modules = nn.ModuleDict()
        self._fresh()

    def _fresh(self) -> None:
        self.call: contextvars.ContextVar[_Call] = contextvars.ContextVar("torchsurgery_flex_call")
        self.lock = threading.Lock()  # output_ptr is appended to from several threads

    def __getstate__(self) -> dict[str, Any]:
        # a copy (deepcopy, pickle) gets its own call variable and lock
        return {k: v for k, v in self.__dict__.items() if k not in ("call", "lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()

    def capture(self, key: str, tensor: torch.Tensor, into: OutputPtr | None = None) -> None:
        """Keep a CPU copy of ``tensor`` under ``key``: in ``into``, in this forward's
        captures (they reach ``output_ptr`` when it returns), or straight in ``output_ptr``."""
        call = self.call.get(None)
        value = tensor.detach()
        if value.device.type == "cpu":
            value = value.clone()  # an alias would change with later in-place edits
        elif call is not None and torch.cuda.is_available():
            # pinned and non-blocking; forward() synchronises once before returning
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
            value = host
            call.pending_copies = True
        else:
            value = value.to("cpu")
        if into is not None:
            into.setdefault(key, []).append(value)
        elif call is not None:
            call.captures.setdefault(key, []).append(value)
        else:
            with self.lock:
                self.output_ptr.setdefault(key, []).append(value)

    def publish(self, call: _Call) -> None:
        """Append the captures of a finished forward to ``output_ptr``."""
        if call.captures:
            with self.lock:
                for key, values in call.captures.items():
                    self.output_ptr.setdefault(key, []).extend(values)

    def runs(self, hook: HookFunction) -> bool:
        """Whether ``hook`` is on in the current forward (outside one, every hook is)."""
        call = self.call.get(None)
        return call is None or call.active is None or hook in call.active

    def run(self, binding: _Binding, module: nn.Module | None, obj: Any) -> Any:
        """Capture and edit the chosen tensor of ``obj``; ``None`` when nothing changed."""
        if torch.compiler.is_compiling():
            # Traced, the group choice would be frozen into the graph: run outside it, so the
            # choice is made on every call (and captures happen as in eager mode).
            return _eager_run()(self, binding, module, obj)
        return self._run(binding, module, obj)

    def _run(self, binding: _Binding, module: nn.Module | None, obj: Any) -> Any:
        hook = binding.hook
        if not self.runs(hook):
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
        new_local = self.routing.route(self, binding, module, local, edit)
        if new_local is None:
            return None
        new_leaves = list(leaves)
        new_leaves[hook.unpack_idx] = new_local
        return rebuild(new_leaves)

    def edit(self, binding: _Binding, module: nn.Module | None, full: torch.Tensor) -> torch.Tensor:
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


_EAGER_RUN: list[Callable[..., Any]] = []


def _eager_run() -> Callable[..., Any]:
    # made on first use: torch._dynamo is slow to import and only needed under compilation
    if not _EAGER_RUN:
        _EAGER_RUN.append(torch.compiler.disable(_Runtime._run, recursive=True))
    return _EAGER_RUN[0]


# The torch hooks are objects, not closures: a deep copy or a pickle of the model then
# carries hooks bound to the copy's own bindings and runtime (its own output_ptr).


class _TorchHook:
    __slots__ = ("binding", "runtime")

    def __init__(self, binding: _Binding, runtime: _Runtime) -> None:
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

    def __init__(self, binding: _Binding, runtime: _Runtime, owner: nn.Module | None) -> None:
        super().__init__(binding, runtime)
        self.owner = owner

    def __call__(self, grad: torch.Tensor) -> Any:
        return self.runtime.run(self.binding, self.owner, grad)


def _make_torch_hook(binding: _Binding, runtime: _Runtime, owner: nn.Module | None) -> _TorchHook:
    if binding.hook_type == "forward":
        return _ForwardHook(binding, runtime)
    if binding.hook_type == "forward_pre":
        return _ForwardPreHook(binding, runtime)
    if binding.hook_type in ("full_backward", "full_backward_pre"):
        return _BackwardHook(binding, runtime)
    return _TensorHook(binding, runtime, owner)


# A HookFunction called directly as a torch hook acts for the wrapper that registered it last.
_DIRECT: weakref.WeakKeyDictionary[HookFunction, Any] = weakref.WeakKeyDictionary()


def call_directly(hook: HookFunction, args: tuple[Any, ...]) -> Any:
    """Run ``hook`` as the torch hook its last registration made (see ``HookFunction.__call__``)."""
    torch_hook = _DIRECT.get(hook)
    if torch_hook is None or torch_hook.binding.handle is None:
        state = "was restored" if torch_hook is not None else "is not registered with a FlexModel"
        raise RuntimeError(
            f"torchsurgery.HookFunction.__call__: {hook!r} {state}; register it first "
            "(flex.register_forward_hook(hook) and the like): that tells it its hook type and output_ptr"
        )
    return torch_hook(*args)


def _distributed_available() -> bool:
    import torch.distributed as dist

    return dist.is_available()


def _is_fully_sharded(model: nn.Module) -> bool:
    if not _distributed_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _fsdp1_class() -> type | None:
    # an FSDP1 model exists only once its module has been imported
    if "torch.distributed.fsdp" not in sys.modules:
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def unwrap_with_prefixes(module: nn.Module) -> tuple[nn.Module, list[str]]:
    """The model inside DDP, DataParallel, FSDP1 and ``torch.compile`` wrappers, and the
    prefixes their names put before the model's own (longest first).

    FSDP2 (``fully_shard``) swaps classes in place and adds no prefix, so it needs nothing here.

    Example:
        >>> m = nn.Linear(1, 1)
        >>> root, prefixes = unwrap_with_prefixes(nn.DataParallel(m))
        >>> root is m, prefixes
        (True, ['module.'])
    """
    fsdp1 = _fsdp1_class()
    prefixes = [""]
    steps: tuple[str, ...]
    while True:
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            module, steps = module.module, ("module.",)
        elif fsdp1 is not None and isinstance(module, fsdp1):
            # named_modules() says _fsdp_wrapped_module; flex_model's users write module.
            module, steps = module._fsdp_wrapped_module, ("_fsdp_wrapped_module.", "module.")  # type: ignore[assignment]
        elif isinstance(getattr(module, "_orig_mod", None), nn.Module):
            module, steps = module._orig_mod, ("_orig_mod.",)  # type: ignore[assignment]
        else:
            return module, sorted((p for p in prefixes if p), key=len, reverse=True)
        prefixes = [p + step for p in prefixes for step in steps]


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside DDP, DataParallel, FSDP1 and ``torch.compile`` wrappers.

    Example:
        >>> m = nn.Linear(1, 1)
        >>> unwrap(nn.DataParallel(m)) is m
        True
    """
    return unwrap_with_prefixes(module)[0]


def _split_prefix(pattern: str, prefixes: list[str]) -> tuple[str, str]:
    """``(prefix, bare name)``: both name forms (``module.fc1`` and ``fc1``) are accepted."""
    for prefix in prefixes:
        if pattern.startswith(prefix):
            return prefix, pattern[len(prefix) :]
    return "", pattern


def invalidate_compiled(model: nn.Module) -> None:
    """Drop the code ``torch.compile`` made for ``model``, so hook changes take effect.

    Dynamo does not guard on module hooks, so code compiled before a hook was added
    (or removed) would keep running without it (or with it). The compiled frames are
    the ``forward`` of the model's module classes, or the wrapper Dynamo puts around a
    ``torch.nn`` container; each recompiles on its next call.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return  # nothing was ever compiled in this process
    import types

    from torch._dynamo import eval_frame, external_utils

    codes = {f.__code__ for m in model.modules() if hasattr(f := type(m).forward, "__code__")}
    codes.update(c for c in external_utils.wrap_inline.__code__.co_consts if isinstance(c, types.CodeType))
    for code in codes:
        eval_frame.reset_code(code)


def _remove_bindings(bindings: list[_Binding]) -> None:
    for binding in bindings:
        if binding.handle is not None:
            binding.handle.remove()
            binding.handle = None
    bindings.clear()


class FlexRecord(_undo.Record):
    """The undo-log entry of a FlexModel wrapper on the model it wraps."""

    kind = "flex"

    def __init__(self, bindings: list[_Binding], routing: Routing) -> None:
        super().__init__()
        self.bindings = bindings
        self.routing = routing

    def describe(self) -> str:
        return f"FlexModel wrapper ({len(self.bindings)} hooks)"

    def undo(self, module: nn.Module) -> None:
        _remove_bindings(self.bindings)
        self.routing.close()
        _undo.remove(module, self)
        invalidate_compiled(module)


def _finalize(module_ref: weakref.ReferenceType[nn.Module], record: FlexRecord) -> None:
    module = module_ref()
    if module is not None:
        record.undo(module)
    else:
        _remove_bindings(record.bindings)
        record.routing.close()


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

    Across ranks: ``output_ptr`` is filled on the layout's first rank alone (global rank 0
    by default), at the end of each forward (and each backward, for gradient hooks);
    ``save_ctx`` is each rank's own; trainable modules are copied from rank 0 when
    registered and their gradients are summed over the tensor-parallel ranks of a stage and
    averaged over the replicas, so every rank holds the gradient one process would compute.

    Captures of one forward reach ``output_ptr`` together when it returns; the group choice
    and the captures belong to the call, so threads may share a wrapper.

    Raises:
        TypeError: ``module`` is not a module or ``output_ptr`` not a dict.
        ValueError: a parallel size is not a positive integer, or the sizes do not
            multiply to the number of ranks (the numbers are named).
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
        process_group: Any = None,
        *,
        device_mesh: Any = None,
    ) -> None:
        what = "torchsurgery.FlexModel"
        if not isinstance(module, nn.Module):
            raise TypeError(f"{what}: expected an nn.Module to wrap, got {type(module).__name__}")
        if isinstance(module, FlexModel):
            raise TypeError(f"{what}: the model is already a FlexModel; wrap the model it holds (flex.module)")
        if not isinstance(output_ptr, dict):
            raise TypeError(f"{what}: output_ptr must be a dict, got {type(output_ptr).__name__}")
        sizes = {"tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size,
                 "data_parallel_size": data_parallel_size}
        for key, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{what}: {key} must be a positive int, got {value!r}")
        super().__init__()
        if process_group is not None or device_mesh is not None or any(v > 1 for v in sizes.values()):
            if not _distributed_available():
                raise RuntimeError(
                    f"{what}: {sizes} with process_group={process_group!r} need torch.distributed, "
                    "which this build of torch does not include; run in one process (all sizes 1)"
                )
            from torchsurgery.distributed import DistributedRouting, make_layout

            layout = make_layout(process_group=process_group, device_mesh=device_mesh, **sizes)
            routing: Routing = DistributedRouting(layout)
            # a device mesh gives the sizes
            tensor_parallel_size, pipeline_parallel_size, data_parallel_size = layout.tp_size, layout.pp_size, layout.dp_size
        else:
            routing = LocalRouting()
        runtime = _Runtime(output_ptr, routing)
        bindings: list[_Binding] = []
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
        d["tp_size"], d["pp_size"], d["dp_size"] = tensor_parallel_size, pipeline_parallel_size, data_parallel_size
        d["process_group"] = process_group
        self.training = module.training
        _undo.push(module, record)
        d["_finalizer"] = weakref.finalize(self, _finalize, weakref.ref(module), record)

    # ------------------------------------------------------------------ state

    @property
    def output_ptr(self) -> OutputPtr:
        """The dict captured activations are appended to."""
        return self._runtime.output_ptr

    @output_ptr.setter
    def output_ptr(self, value: OutputPtr) -> None:
        if not isinstance(value, dict):
            raise TypeError(f"torchsurgery.FlexModel: output_ptr must be a dict, got {type(value).__name__}")
        self._runtime.output_ptr = value

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
        d["_finalizer"] = weakref.finalize(new, _finalize, weakref.ref(d["module"]), d["_record"])
        return new

    def __getstate__(self) -> dict[str, Any]:
        self._check_alive("__getstate__")
        return {k: v for k, v in self.__dict__.items() if k != "_finalizer"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__["_finalizer"] = weakref.finalize(self, _finalize, weakref.ref(self.module), self._record)

    def _check_alive(self, what: str) -> None:
        if self._record not in _undo.records(self.module):
            raise RuntimeError(
                f"torchsurgery.FlexModel.{what}: this wrapper was restored; wrap the model again"
            )

    # ------------------------------------------------------- nn.Module surface

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``state_dict`` (same keys)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the wrapped model (same keys)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

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
        call = _Call(active)
        token = runtime.call.set(call)
        try:
            outputs = runtime.routing.forward(self.module, args, kwargs)
        except BaseException:
            # this forward's captures are dropped; other threads' are untouched
            runtime.routing.end_forward(runtime.output_ptr, failed=True)
            raise
        finally:
            runtime.call.reset(token)
            if call.pending_copies:
                torch.cuda.current_stream().synchronize()
        runtime.publish(call)
        runtime.routing.end_forward(runtime.output_ptr)
        return outputs

    def backward(self, loss: torch.Tensor | None = None) -> None:
        """Run the backward of ``loss``, through every pipeline stage when there are several.

        In one process, and with tensor or data parallelism, this is ``loss.backward()``.
        With pipeline stages, call it on every rank after the forward: with the loss on the
        last stage's ranks and ``None`` on the others, which go on from the gradients the
        next stage sends back. Gradient hooks then run on every stage and their captures
        reach rank 0 when it returns.

        Raises:
            TypeError: no loss tensor where one is needed (one process, or the last stage).
            RuntimeError: another rank's backward failed (pipeline stages).
        """
        self._check_alive("backward")
        self._runtime.routing.backward(self._runtime, loss)

    # --------------------------------------------------------- registration

    def _targets(
        self, hook: HookFunction, hook_type: str, *, local: bool = False
    ) -> list[tuple[str, nn.Module | torch.Tensor, nn.Module | None]]:
        """What ``hook`` binds to here, named as the hook names it (with or without the
        prefix of a DDP/FSDP1/compile wrapper); ``local``: a name this process already matched."""
        what = f"torchsurgery.FlexModel ({hook_type} hook)"
        root, prefixes = unwrap_with_prefixes(self.module)
        prefix, pattern = _split_prefix(hook.module_name, prefixes)
        routing = self._runtime.routing
        if hook_type == "tensor":
            if _is_fully_sharded(root):
                raise ValueError(
                    f"{what}: {pattern!r}: FSDP2 hands each parameter its reduced gradient directly, "
                    "so a gradient hook on it never runs; read param.grad.full_tensor() after backward"
                )
            params = dict(root.named_parameters())
            names = [n for n in params if glob_match(pattern, n)] if is_glob(pattern) else [n for n in params if n == pattern]
            if not local and not routing.matched_anywhere(bool(names), hook_type, pattern):
                raise no_match(what, pattern, list(params), kind="parameter")
            return [(prefix + n, params[n], root.get_submodule(n.rpartition(".")[0])) for n in names]
        modules = dict(root.named_modules())
        names = [n for n in modules if glob_match(pattern, n)]
        if not local and not routing.matched_anywhere(bool(names), hook_type, pattern):
            raise no_match(what, pattern, [n for n in modules if n])
        return [(prefix + n, modules[n], None) for n in names]  # none here: another pipeline stage holds it

    def _register(self, hook: HookFunction, hook_type: str, *, local: bool = False) -> None:
        self._check_alive(f"register ({hook_type})")
        if not isinstance(hook, HookFunction):
            raise TypeError(f"torchsurgery.FlexModel: expected a HookFunction, got {type(hook).__name__}")
        if any(b.hook is hook and b.hook_type == hook_type for b in self._bindings):
            raise ValueError(f"torchsurgery.FlexModel: {hook!r} is already registered as a {hook_type} hook")
        targets = self._targets(hook, hook_type, local=local)
        added: list[_Binding] = []
        fns: list[_TorchHook] = []
        try:
            for name, target, owner in targets:
                taken = sum(1 for b in self._bindings if b.name == name)
                binding = _Binding(hook, hook_type, name, name if taken == 0 else f"{name}#{taken + 1}")
                fn: Any = _make_torch_hook(binding, self._runtime, owner)  # typed per hook kind by torch
                if isinstance(target, torch.Tensor):
                    binding.handle = target.register_hook(fn)
                elif hook_type == "forward":
                    binding.handle = target.register_forward_hook(fn)
                elif hook_type == "forward_pre":
                    binding.handle = target.register_forward_pre_hook(fn, with_kwargs=True)
                elif hook_type == "full_backward":
                    binding.handle = target.register_full_backward_hook(fn)
                else:
                    binding.handle = target.register_full_backward_pre_hook(fn)
                self._bindings.append(binding)
                added.append(binding)
                fns.append(fn)
        except BaseException:
            for binding in added:
                self._bindings.remove(binding)
            _remove_bindings(added)
            raise
        self._groups.register(hook)
        if fns:
            _DIRECT[hook] = fns[0]
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
        parameter_name = _split_prefix(parameter_name, prefixes)[1]
        if parameter_name not in params:
            advice = "with pipeline parallelism, ask on the ranks of the stage that holds it" if self.pp_size > 1 else ""
            raise no_match(what, parameter_name, list(params), kind="parameter", advice=advice)
        local = params[parameter_name].detach()
        probe = HookFunction(parameter_name, expected_shape)
        return self._runtime.routing.gather_parameter(local, probe).to("cpu", copy=True)

    # --------------------------------------------------------------- restore

    def restore(self) -> nn.Module:
        """Remove every hook and return the wrapped model, exactly as it was wrapped.

        Works whatever groups were active or whether a forward failed; afterwards this
        wrapper can no longer be used.
        """
        if self._record in _undo.records(self.module):
            self._record.undo(self.module)
        self._finalizer.detach()
        return self.module
