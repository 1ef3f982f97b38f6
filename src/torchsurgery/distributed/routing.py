"""Routing activations between the ranks of a ``pp x dp x tp`` layout for FlexModel hooks.

For each hook call on each rank:

1. **tensor parallel**: the local shard becomes the full tensor. A ``DTensor`` is
   gathered with ``full_tensor()``; a plain tensor along the dimension that
   :mod:`~torchsurgery.distributed.sharding` finds. Capture-only hooks gather to the
   first tensor-parallel rank alone; editing hooks gather to every rank.
2. **capture**: the first tensor-parallel rank of each data-parallel replica and stage
   keeps a CPU copy; at the end of the forward (or backward) every copy goes to rank 0
   in one message per rank, where data-parallel pieces are concatenated along the batch
   dimension (sizes may differ) and each stage's keys are added in stage order. A
   parameter's gradient (``register_hook``) has no batch dimension: the replicas'
   gradients are averaged, as DDP averages them. Activation gradients are divided by
   the data-parallel size: each replica's backward starts from its own loss, so they
   are that many times the gradient of the mean loss DDP optimizes.
3. **edit**: by default every rank of the stage runs the editing function on the same
   input (the global batch, gathered over data-parallel ranks; or, with
   ``edit_batch="local"``, its own batch), so nothing but the input travels; with
   ``edit_on="rank0"`` the first rank runs it and broadcasts the result (for edits that
   are not deterministic). Every rank then learns whether any rank's edit raised, so a
   failure stops every rank with the rank and the hook named instead of a hang.
4. **scatter**: each rank keeps its own batch rows and its own shard of the edited
   tensor. Gathers are differentiable, so gradients reach every rank's activations.

Pipeline stages, forward and backward, are driven by
:class:`~torchsurgery.distributed.pipeline.Pipeline`; under pipeline parallelism the
captures of gradient hooks ship when ``FlexModel.backward`` returns.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.hooks import RemovableHandle

from torchsurgery.distributed import _wire
from torchsurgery.distributed.collectives import (
    agree_on_failure,
    broadcast_from_root,
    gather_along,
    gather_to_root,
    piece_sizes,
)
from torchsurgery.distributed.layout import Layout
from torchsurgery.distributed.pipeline import Pipeline
from torchsurgery.distributed.sharding import dim_from_expected_shape, dim_from_plan
from torchsurgery.flex.routing import check_expected_shape

__all__ = ["DistributedRouting"]

_WHAT = "torchsurgery.FlexModel"
_BACKWARD = ("full_backward", "full_backward_pre", "tensor")
_ACTIVATION_GRADS = ("full_backward", "full_backward_pre")
OutputPtr = dict[str, list[torch.Tensor]]


def _receive_all(into: list[tuple[torch.Tensor, int]], group: dist.ProcessGroup) -> None:
    """Receive into each tensor from its global rank, all at once."""
    works = [dist.irecv(tensor, src=rank, group=group) for tensor, rank in into]
    for work in works:
        if work is not None:  # None only for ranks outside the group, which none are
            work.wait()


class DistributedRouting:
    """Routes hook activations over a :class:`~torchsurgery.distributed.layout.Layout`.

    Args:
        layout: this rank's place in the layout and its groups.
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.pending: OutputPtr = {}
        self._runtime: Any = None
        self._plan_dims: dict[int, int | None] = {}
        self._callback_queued = False
        self._summed: set[str] = set()  # parameter-gradient keys: replicas' pieces add up
        self._grad_handles: list[RemovableHandle] = []
        self._sends: list[tuple[Any, torch.Tensor]] = []
        # frame capacity per sender position (rank 0 keeps every sender's; a sender its own at 0)
        self._capacity: dict[int, int] = dict.fromkeys(range(len(layout.ranks)), 0)
        # captures go straight to output_ptr when no other rank has any to send
        self._direct = layout.dp_size == 1 and layout.pp_size == 1
        self._pipeline = Pipeline(layout)
        self._in_backward = False  # inside backward(): pipeline stages ship captures afterwards

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"{_WHAT}: a distributed wrapper cannot be copied or pickled: its process groups belong "
            "to this process; copy or save the model (flex.module) before wrapping it or after restore()"
        )

    # --------------------------------------------------------------- shards

    def _shard_dim(self, local: torch.Tensor, binding: Any, module: nn.Module | None) -> int | None:
        layout = self.layout
        expected = binding.hook.expected_shape
        if expected is not None and layout.dp_size > 1:
            expected = (None, *expected[1:])  # the batch entry is the global batch's
        if layout.tp_size == 1:
            if expected is not None:
                check_expected_shape(local, Namespace(expected_shape=expected, module_name=binding.name))
            return None
        if expected is not None:
            return dim_from_expected_shape(local, expected, binding.name, layout.tp_size)
        if module is None or binding.hook_type not in ("forward", "full_backward_pre"):
            return None
        key = id(module)
        if key not in self._plan_dims:
            self._plan_dims[key] = dim_from_plan(module, local.dim())
        return self._plan_dims[key]

    # ---------------------------------------------------------------- hooks

    def route(
        self,
        runtime: Any,
        binding: Any,
        module: nn.Module | None,
        local: torch.Tensor,
        edit: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> torch.Tensor | None:
        """Capture (and edit) one hook's activation; the new local tensor, or ``None``."""
        layout = self.layout
        self._runtime = runtime
        if binding.hook_type in _BACKWARD and layout.pp_size > 1 and not self._in_backward:
            raise RuntimeError(
                f"{_WHAT}: a gradient hook on {binding.name!r} ran in a backward that did not go "
                "through the pipeline; call flex.backward(loss) on every rank (loss on the last stage)"
            )
        if binding.hook_type in _BACKWARD and not self._direct and not self._in_backward and not self._callback_queued:
            # ship gradient captures when this backward ends, on every rank alike
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        dtensor = local if isinstance(local, DTensor) else None
        dim = None if dtensor is not None else self._shard_dim(local, binding, module)
        if dtensor is not None:
            full = dtensor.full_tensor()
        elif dim is None:
            full = local
        elif edit is None:
            whole = gather_to_root(local, dim, layout.tp_group)  # only rank 0 of the group needs it
            if whole is not None:
                self._capture(runtime, binding, whole)
            return None
        else:
            full = gather_along(local, dim, layout.tp_group, [local.shape[dim]] * layout.tp_size)
        if layout.tp_rank == 0:
            self._capture(runtime, binding, full)
        if edit is None:
            return None
        edited = self._edit(binding, full, edit)
        if dtensor is not None:
            mesh = dtensor.device_mesh
            whole = DTensor.from_local(edited, mesh, [Replicate()] * mesh.ndim, run_check=False)
            return whole.redistribute(mesh, dtensor.placements)
        if dim is not None:
            return edited.chunk(layout.tp_size, dim)[layout.tp_rank]
        return edited

    def _capture(self, runtime: Any, binding: Any, full: torch.Tensor) -> None:
        if binding.hook_type == "tensor":
            self._summed.add(binding.key)  # averaged over the replicas when they reach rank 0
        elif binding.hook_type in _ACTIVATION_GRADS and self.layout.dp_size > 1:
            full = full / self.layout.dp_size  # see _edit
        runtime.capture(binding.key, full, None if self._direct else self.pending)

    def _edit(self, binding: Any, full: torch.Tensor, edit: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        layout = self.layout
        hook = binding.hook
        target, sizes = full, None
        share = layout.tp_group
        # Each replica's backward starts from its own loss, and DDP/FSDP average the replicas'
        # parameter gradients: the objective is the mean of the replicas' losses, of which a
        # replica's activation gradients are dp_size times the gradient. Editing functions see
        # the gradient of that objective (one process's, for equal batches and mean losses).
        scale = layout.dp_size if binding.hook_type in _ACTIVATION_GRADS else 1
        if layout.dp_size > 1 and binding.hook_type == "tensor":
            # a parameter's gradient has no batch dimension: the replicas' mean, the same on
            # every replica, so the edited gradient is what DDP's averaging leaves
            target = full.detach().clone()
            dist.all_reduce(target, group=layout.dp_group)
            target = target / layout.dp_size
            share = layout.stage_group
        elif layout.dp_size > 1 and hook.edit_batch == "global":
            sizes = piece_sizes(full, 0, layout.dp_group, layout.device)
            target = gather_along(full, 0, layout.dp_group, sizes)
            share = layout.stage_group
        error: BaseException | None = None
        result: torch.Tensor | None = None
        if hook.edit_on == "all" or dist.get_rank(share) == 0:
            try:
                result = edit(target / scale) * scale if scale != 1 else edit(target)
            except Exception as exc:  # every rank must hear of it before anyone raises
                error = exc
        if hook.edit_on == "rank0":
            # a constant for autograd on every rank alike: only one rank computed it
            sent = result.detach() if result is not None else None
            result = broadcast_from_root(sent, share, layout.device)
        failed = agree_on_failure(result is None, layout.stage_group, layout.device)
        if failed:
            ranks = dist.get_process_group_ranks(layout.stage_group)
            names = [ranks[i] for i in failed]
            message = (
                f"{_WHAT}: the editing function of the hook on {binding.name!r} raised on rank(s) {names}; "
                "every rank of the stage stops here (see the traceback of those ranks)"
            )
            if error is not None:
                error.add_note(message)
                raise error
            raise RuntimeError(message)
        assert result is not None
        if sizes is not None:
            offset = sum(sizes[: layout.dp_rank])
            result = result.narrow(0, offset, sizes[layout.dp_rank])
        return result

    # --------------------------------------------------------------- forward

    def forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run this rank's part of the model (its pipeline stage)."""
        # captures made outside the wrapper (generate) stay pending: they ship with this pass
        self._callback_queued = False
        if self.layout.pp_size == 1:
            return module(*args, **kwargs)
        return self._pipeline.forward(module, args, kwargs)

    def backward(self, runtime: Any, loss: torch.Tensor | None) -> None:
        """Backward on every rank: through the pipeline stages, then captures to rank 0."""
        if self.layout.pp_size == 1:
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"{_WHAT}.backward: expected the loss tensor, got {type(loss).__name__}")
            loss.backward()
            return
        self._runtime = runtime
        self._in_backward = True
        try:
            self._pipeline.backward(loss)
        except BaseException:
            self._exchange(runtime.output_ptr, True)
            raise
        finally:
            self._in_backward = False
        self._exchange(runtime.output_ptr, False)

    def end_forward(self, output_ptr: OutputPtr, *, failed: bool = False) -> None:
        """Ship this forward's captures to rank 0, which raises if a sender failed."""
        if self._direct:
            return
        self._exchange(output_ptr, failed)

    def _end_backward(self) -> None:
        self._callback_queued = False
        if self._runtime is not None:
            self._exchange(self._runtime.output_ptr, False)

    def _exchange(self, output_ptr: OutputPtr, failed: bool) -> None:
        # Point to point only: each sender (the first tensor-parallel rank of every replica
        # and stage) sends rank 0 one frame per pass, (failed, size) and its captures; a
        # collective here would cost every rank a round trip per forward.
        layout = self.layout
        pending, self.pending = self.pending, {}
        root, group, device = layout.ranks[0], layout.group, layout.device
        if not layout.is_root:
            if layout.tp_rank != 0:
                return
            items = [(key, t) for key, values in pending.items() for t in values]
            data = _wire.pack(items, device=device) if items and not failed else None
            first, rest = _wire.frame(data, status=int(failed), capacity=self._capacity[0], device=device)
            self._capacity[0] = _wire.next_capacity(self._capacity[0], 0 if data is None else data.numel())
            self._settle_sends()
            # not waited for here: this rank goes on while rank 0 receives
            self._sends = [(dist.isend(t, dst=root, group=group), t) for t in (first, rest) if t is not None]
            return
        senders = [(p, layout.ranks[p]) for p in range(layout.tp_size, len(layout.ranks), layout.tp_size)]
        firsts = {p: torch.empty(_wire.FRAME_HEAD + self._capacity[p], dtype=torch.uint8, device=device) for p, _ in senders}
        _receive_all([(firsts[p], rank) for p, rank in senders], group)
        heads = {p: _wire.read_head(firsts[p]) for p, _ in senders}
        overflow = {p: torch.empty(size, dtype=torch.uint8, device=device) for p, (_, size) in heads.items() if size > self._capacity[p]}
        # always drained, so the next pass starts with nothing in flight
        _receive_all([(overflow[p], rank) for p, rank in senders if p in overflow], group)
        buffers = {p: overflow.get(p, firsts[p][_wire.FRAME_HEAD : _wire.FRAME_HEAD + size]) for p, (_, size) in heads.items() if size}
        for p, (_, size) in heads.items():
            self._capacity[p] = _wire.next_capacity(self._capacity[p], size)
        bad = [rank for p, rank in senders if heads[p][0]]
        if failed:
            return  # this rank's own exception is already on its way
        if bad:
            raise RuntimeError(
                f"{_WHAT}: rank(s) {bad} failed in this pass, so their captures are missing; "
                "see the traceback of those ranks"
            )
        received: dict[int, OutputPtr] = {0: pending}
        for p, buffer in buffers.items():
            part: OutputPtr = {}
            for key, tensor in _wire.unpack(buffer)[1]:
                # views of a buffer received for this pass alone: no copy needed on a CPU
                part.setdefault(key, []).append(tensor.cpu())
            received[p] = part
        self._merge(output_ptr, received)

    def _settle_sends(self) -> None:
        """Wait for the previous pass's sends (their tensors stay alive until then)."""
        for work, _ in self._sends:
            if work is not None:
                work.wait()
        self._sends = []

    def _merge(self, output_ptr: OutputPtr, received: dict[int, OutputPtr]) -> None:
        layout = self.layout
        step = layout.tp_size
        for stage in range(layout.pp_size):
            replicas = [
                received.get((stage * layout.dp_size + d) * step, {}) for d in range(layout.dp_size)
            ]
            keys: dict[str, None] = {}
            for part in replicas:
                keys.update(dict.fromkeys(part))
            for key in keys:
                count = max(len(part.get(key, ())) for part in replicas)
                for i in range(count):
                    pieces = [part[key][i] for part in replicas if i < len(part.get(key, ()))]
                    if len(pieces) == 1:
                        value = pieces[0]
                    elif key in self._summed:
                        value = torch.stack(pieces).sum(0) / layout.dp_size
                    else:
                        value = torch.cat(pieces)
                    output_ptr.setdefault(key, []).append(value)

    # ----------------------------------------------------------- the rest

    def matched_anywhere(self, found: bool, hook_type: str, name: str) -> bool:
        """Whether a hook's module exists on some stage (every rank calls this)."""
        layout = self.layout
        if layout.pp_size == 1:
            return found
        flag = torch.tensor([int(found)], device=layout.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=layout.pp_group)
        return bool(flag.item())

    def gather_parameter(self, local: torch.Tensor, hook: Any) -> torch.Tensor:
        """A parameter unsharded: a DTensor's ``full_tensor()``, or gathered by its ``expected_shape``."""
        if isinstance(local, DTensor):
            return local.full_tensor()
        dim = dim_from_expected_shape(local, hook.expected_shape, hook.module_name, self.layout.tp_size)
        if dim is None or self.layout.tp_size == 1:
            return local
        return gather_along(local, dim, self.layout.tp_group, [local.shape[dim]] * self.layout.tp_size)

    def prepare_trainable(self, module: nn.Module) -> None:
        """Start every rank's copy of a trainable module equal; sum its gradients over the stage."""
        layout = self.layout
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=layout.ranks[0], group=layout.group)
        for param in module.parameters():
            if param.requires_grad:
                self._grad_handles.append(param.register_hook(self._sum_over_stage))

    def _sum_over_stage(self, grad: torch.Tensor) -> torch.Tensor:
        # each rank's gradient covers only its shard and its batch rows; the replicas'
        # parts are averaged, as DDP averages the model's own gradients (see _edit)
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=self.layout.stage_group)
        return total / self.layout.dp_size if self.layout.dp_size > 1 else total

    def close(self) -> None:
        """Finish sending captures; remove the gradient hooks put on trainable modules."""
        self._settle_sends()
        for handle in self._grad_handles:
            handle.remove()
        self._grad_handles.clear()
