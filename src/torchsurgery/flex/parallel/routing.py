"""FlexModel hooks over the ranks of a ``pp x dp x tp`` layout: one routing, four jobs.

For each hook call on each rank:

1. **tensor parallel** (:mod:`~torchsurgery.flex.parallel.tensor_parallel`): the local
   shard becomes the full tensor;
2. **capture** (:mod:`~torchsurgery.flex.parallel.shipping`): the first tensor-parallel
   rank keeps a copy, shipped at the end of the pass to every rank (or to the first);
   with one replica and one stage, each tensor-parallel rank keeps its own instead;
3. **edit** (:mod:`~torchsurgery.flex.parallel.edits`): the ranks of the stage run the
   editing function and agree on whether it failed;
4. **scatter**: each rank keeps its own batch rows and its own shard of the edited
   tensor. Gathers are differentiable, so gradients reach every rank's activations.

Trainable modules are kept in step by :mod:`~torchsurgery.flex.parallel.gradients`, and
pipeline stages, forward and backward, are driven by
:class:`~torchsurgery.flex.parallel.pipeline.Pipeline`; under pipeline parallelism the
captures of gradient hooks ship when ``FlexModel.backward`` returns.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch import nn

from torchsurgery.flex.captures import Captures
from torchsurgery.flex.hook_function import GRADIENT_HOOK_TYPES, Binding, Edit, HookType, Shape
from torchsurgery.flex.parallel.edits import StageEdits
from torchsurgery.flex.parallel.gradients import TrainableGradients
from torchsurgery.flex.parallel.layout import Layout, make_layout
from torchsurgery.flex.parallel.pipeline import Pipeline
from torchsurgery.flex.parallel.request import CapturesOn, ParallelRequest, ParallelSizes
from torchsurgery.flex.parallel.shipping import CaptureShipping
from torchsurgery.flex.parallel.tensor_parallel import TensorParallel

__all__ = ["DistributedRouting", "distributed_routing"]

_WHAT = "torchsurgery.FlexModel"


class DistributedRouting:
    """Routes hook activations over a :class:`~torchsurgery.flex.parallel.layout.Layout`.

    A :class:`~torchsurgery.flex.routing.Routing`; ``FlexModel`` builds one through
    :func:`distributed_routing` when given parallel sizes, a process group or a mesh.

    Args:
        layout: this rank's place in the layout and its groups.
        captures_on: which ranks' ``output_ptr`` receives the captures.

    Example:
        On every rank of a two-rank tensor-parallel world::

            routing = DistributedRouting(make_layout(tensor_parallel_size=2))
            routing.sizes  # ParallelSizes(tensor=2, pipeline=1, data=1)
    """

    def __init__(self, layout: Layout, *, captures_on: CapturesOn = "every_rank") -> None:
        self.layout = layout
        self.sizes = ParallelSizes(tensor=layout.tp_size, pipeline=layout.pp_size, data=layout.dp_size)
        self._tensor_parallel = TensorParallel(layout)
        self._edits = StageEdits(layout)
        self._shipping = CaptureShipping(layout, every_rank=captures_on == "every_rank")
        self._gradients = TrainableGradients(layout)
        self._pipeline = Pipeline(layout)
        self._in_backward = False  # inside backward(): pipeline stages ship captures afterwards

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(
            f"{_WHAT}: a distributed wrapper cannot be copied or pickled: its process groups belong "
            "to this process; copy or save the model (flex.module) before wrapping it or after restore()"
        )

    def route(
        self, binding: Binding, module: nn.Module | None, local: torch.Tensor, edit: Edit | None, captures: Captures
    ) -> torch.Tensor | None:
        """Capture (and edit) one hook's activation; the new local tensor, or ``None``."""
        if binding.hook_type in GRADIENT_HOOK_TYPES and not self._in_backward:
            if self.layout.pp_size > 1:
                raise RuntimeError(
                    f"{_WHAT}: a gradient hook on {binding.name!r} ran in a backward that did not go "
                    "through the pipeline; call flex.backward(loss) on every rank (loss on the last stage)"
                )
            self._shipping.ship_after_backward(captures)
        every_tp_rank = self._shipping.every_tp_rank  # each tensor-parallel rank keeps its own copy
        source = local if edit is not None else local.detach()  # a capture needs no gradient path
        whole = self._tensor_parallel.gather(source, binding, module, everywhere=edit is not None or every_tp_rank)
        if whole.full is not None and (self.layout.tp_rank == 0 or every_tp_rank):
            self._shipping.keep(captures, binding, whole.full)
        if edit is None or whole.full is None:
            return None
        edited = self._edits.run(binding, whole.full, edit)
        return self._tensor_parallel.scatter(edited, whole)

    def forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run this rank's part of the model (its pipeline stage)."""
        # captures made outside the wrapper (generate) stay pending: they ship with this pass
        self._shipping.new_pass()
        if self.layout.pp_size == 1:
            return module(*args, **kwargs)
        return self._pipeline.forward(module, args, kwargs)

    def end_forward(self, captures: Captures, *, failed: bool = False) -> None:
        """Deliver this forward's captures; the ranks that receive them raise if a sender failed."""
        self._shipping.ship(captures.output_ptr, failed=failed)

    def backward(self, captures: Captures, loss: torch.Tensor | None) -> None:
        """Backward on every rank: through the pipeline stages, then the captures delivered."""
        if self.layout.pp_size == 1:
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"{_WHAT}.backward: expected the loss tensor, got {type(loss).__name__}")
            loss.backward()
            return
        self._in_backward = True
        try:
            self._pipeline.backward(loss)
        except BaseException:
            self._shipping.ship(captures.output_ptr, failed=True)
            raise
        finally:
            self._in_backward = False
        self._shipping.ship(captures.output_ptr, failed=False)

    def matched_anywhere(self, found: bool, hook_type: HookType, name: str) -> bool:
        """Whether a hook's module exists on some stage (every rank calls this)."""
        return self._pipeline.on_any_stage(found)

    def gather_parameter(self, local: torch.Tensor, name: str, expected_shape: Shape | None) -> torch.Tensor:
        """A parameter unsharded: a DTensor's ``full_tensor()``, or gathered by ``expected_shape``."""
        return self._tensor_parallel.gather_parameter(local, name, expected_shape)

    def prepare_trainable(self, module: nn.Module) -> None:
        """Start every rank's copy of a trainable module equal; sum its gradients over the stage."""
        self._gradients.prepare(module)

    def close(self) -> None:
        """Finish sending captures; remove the gradient hooks put on trainable modules."""
        self._shipping.settle()
        self._gradients.close()


def distributed_routing(request: ParallelRequest) -> DistributedRouting:
    """The routing of a ``FlexModel`` given parallel sizes, a process group or a device mesh.

    Every rank of the layout must call this, in the same order as its other collective
    calls (it may create the per-axis process groups).
    :func:`~torchsurgery.flex.routing.routing_for` calls it unless a factory was registered
    with :func:`~torchsurgery.flex.routing.register_parallel_routing`.

    Raises:
        ValueError: the sizes do not fit the process group or the mesh (see
            :func:`~torchsurgery.flex.parallel.layout.make_layout`).
        RuntimeError: no process group exists and this is not a torchrun launch.

    Example:
        On every rank of a four-rank world::

            routing = distributed_routing(ParallelRequest.of(tensor_parallel_size=2, data_parallel_size=2))
    """
    layout = make_layout(
        tensor_parallel_size=request.sizes.tensor,
        pipeline_parallel_size=request.sizes.pipeline,
        data_parallel_size=request.sizes.data,
        process_group=request.process_group,
        device_mesh=request.device_mesh,
    )
    return DistributedRouting(layout, captures_on=request.captures_on)
