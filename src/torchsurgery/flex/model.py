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
routing is flex's own :class:`~torchsurgery.flex.parallel.routing.DistributedRouting` (or the one
a factory registered with :func:`~torchsurgery.flex.routing.register_parallel_routing` builds): editing functions see
whole tensors (tensor-parallel shards gathered, data-parallel batches assembled), the
model gets its local part back, captures reach every rank (as in flex_model; or the first
rank alone, with ``captures_on="first_rank"``), and with pipeline parallelism the wrapper
runs this rank's stage and passes activations on.

The wrapper is made of one part per concept: it shares the wrapped model's parameter,
buffer and child dictionaries (:mod:`~torchsurgery.flex.surface`), so ``parameters()``,
``to()``, ``train()`` and friends act on the wrapped model with its own names;
``state_dict()`` is flex_model's (:mod:`~torchsurgery.flex.state`): the model under
``module.`` and the trainable modules under ``trainable_modules.``, so a saved wrapper keeps
what its hooks trained; its hooks, their groups and its undo record are a
:class:`~torchsurgery.flex.registry.HookRegistry`; what they run, forwards included, is a
:class:`~torchsurgery.flex.runtime.HookRuntime`. :meth:`FlexModel.restore` (or
``torchsurgery.restore(model)``, or dropping the wrapper) removes every hook and leaves the
model exactly as it was.
"""

from __future__ import annotations

import copy
from argparse import Namespace
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._names import no_match
from torchsurgery.flex.captures import Captures, OutputPtr
from torchsurgery.flex.hook_function import shape_hint
from torchsurgery.flex.parallel.request import CapturesOn, ParallelRequest
from torchsurgery.flex.registry import HookMethods, HookRegistry
from torchsurgery.flex.routing import routing_for
from torchsurgery.flex.runtime import HookRuntime
from torchsurgery.flex.state import ModelAndTrainables
from torchsurgery.flex.surface import SharedSurface
from torchsurgery.flex.targets import split_prefix, unwrap_with_prefixes

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FlexModel"]


class FlexModel(SharedSurface, ModelAndTrainables, HookMethods):
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
        super().__init__(module)  # not a child: the wrapper's module surface *is* the wrapped model's
        routing = routing_for(request, what)
        runtime = HookRuntime(Captures(output_ptr), routing)
        hooks = HookRegistry(module, runtime)
        d = self.__dict__
        d["_runtime"] = runtime
        d["_hooks"] = hooks
        # a device mesh gives the sizes
        d["tp_size"], d["pp_size"], d["dp_size"] = routing.sizes.tensor, routing.sizes.pipeline, routing.sizes.data
        d["process_group"] = process_group
        self.training = module.training
        _undo.push(module, hooks.record)
        d["_finalizer"] = hooks.finalizer(self)

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
    def wrapped_module_names(self) -> list[str]:
        """Qualified names of every submodule of the wrapped model."""
        return [name for name, _ in self.module.named_modules()]

    @property
    def all_modules_names(self) -> list[str]:
        """Wrapped module names followed by trainable module names."""
        return self.wrapped_module_names + self.trainable_modules_names

    def __deepcopy__(self, memo: dict[int, Any]) -> FlexModel:
        """An independent wrapper around a deep copy of the model: its own hooks, groups,
        ``output_ptr`` (a copy of this one's), ``save_ctx`` and trainable modules."""
        self._hooks.check_alive("__deepcopy__")
        new = object.__new__(type(self))
        memo[id(self)] = new
        d = new.__dict__
        for key, value in self.__dict__.items():
            if key != "_finalizer":
                d[key] = copy.deepcopy(value, memo)  # the memo keeps shared objects shared
        d["_finalizer"] = d["_hooks"].finalizer(new)
        return new

    def __getstate__(self) -> dict[str, Any]:
        self._hooks.check_alive("__getstate__")
        return {k: v for k, v in self.__dict__.items() if k != "_finalizer"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__["_finalizer"] = self._hooks.finalizer(self)

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
        self._hooks.check_alive("forward")
        everything = not complement and (groups == "all" or groups == ["all"] or groups == ("all",))
        active = None if everything else self._hooks.groups.active(groups, complement, "torchsurgery.FlexModel.forward")
        return self._runtime.forward(self.module, args, kwargs, active)

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
        self._hooks.check_alive("backward")
        self._runtime.routing.backward(self._runtime.captures, loss)

    def register_trainable_module(self, name: str, module: nn.Module) -> None:
        """Expose ``module`` to every editing function as ``modules[name]``."""
        self._runtime.add_trainable(name, module)

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

    def restore(self) -> nn.Module:
        """Remove every hook and return the wrapped model, exactly as it was wrapped.

        Works whatever groups were active or whether a forward failed; afterwards this
        wrapper can no longer be used.
        """
        self._hooks.restore()
        self._finalizer.detach()
        return self.module
