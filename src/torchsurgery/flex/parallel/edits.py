"""Running an editing function across the ranks of a pipeline stage, failures agreed on.

By default every rank of the stage runs the editing function on the same input (the
global batch, gathered over data-parallel ranks; or, with ``edit_batch="local"``, its own
rows), so nothing but the input travels; with ``edit_on="rank0"`` the stage's first rank
runs it and broadcasts the result (for edits that are not deterministic). Then every
rank learns whether any rank's edit raised, so a failure stops every rank of the stage
with the ranks and the hook named, instead of leaving the others waiting in the next
collective. Each rank keeps its own batch rows of the result.

Gradients and data parallelism: each replica's backward starts from its own loss, and
DDP/FSDP average the replicas' parameter gradients, so the objective is the mean of the
replicas' losses, of which a replica's activation gradients are ``dp_size`` times the
gradient (:func:`replica_scale`). Editing functions see the gradient of that objective
(one process's, for equal batches and mean losses).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchsurgery.flex.hook_function import Binding, Edit, HookType
from torchsurgery.flex.parallel.collectives import (
    agree_on_failure,
    broadcast_from_root,
    gather_along,
    piece_sizes,
)
from torchsurgery.flex.parallel.layout import Layout

__all__ = ["replica_scale", "StageEdits"]

_WHAT = "torchsurgery.FlexModel"


def replica_scale(layout: Layout, hook_type: HookType) -> int:
    """How many times the gradient of the replicas' mean loss a replica's value is.

    ``dp_size`` for activation gradients (module backward hooks), 1 for everything else:
    activations are not gradients, and parameter gradients are averaged as DDP does.
    """
    return layout.dp_size if hook_type in ("full_backward", "full_backward_pre") else 1


class StageEdits:
    """Runs editing functions for the ranks of one pipeline stage.

    Args:
        layout: this rank's place in the layout and its groups.

    Example:
        On every rank of the stage, with ``full`` the whole (tensor-parallel gathered)
        activation of this rank's replica::

            edited_rows = StageEdits(layout).run(binding, full, edit)
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def _input(self, binding: Binding, full: torch.Tensor) -> tuple[torch.Tensor, list[int] | None, dist.ProcessGroup]:
        """What the editing function sees, the replicas' batch sizes (when their rows were
        gathered), and the group of ranks that see the same input."""
        layout = self.layout
        if layout.dp_size > 1 and binding.hook_type == "tensor":
            # a parameter's gradient has no batch dimension: the replicas' mean, the same on
            # every replica, so the edited gradient is what DDP's averaging leaves
            target = full.detach().clone()
            dist.all_reduce(target, group=layout.dp_group)
            return target / layout.dp_size, None, layout.stage_group
        if layout.dp_size > 1 and binding.hook.edit_batch == "global":
            sizes = piece_sizes(full, 0, layout.dp_group, layout.device)
            return gather_along(full, 0, layout.dp_group, sizes), sizes, layout.stage_group
        return full, None, layout.tp_group

    def run(self, binding: Binding, full: torch.Tensor, edit: Edit) -> torch.Tensor:
        """This rank's rows of the edited ``full`` (every rank of the stage must call this).

        Raises:
            Exception: the editing function's own exception on the ranks where it raised,
                with a note naming every failed rank.
            RuntimeError: on the other ranks, naming the failed ranks and the hook.
        """
        layout = self.layout
        hook = binding.hook
        target, sizes, share = self._input(binding, full)
        scale = replica_scale(layout, binding.hook_type)
        error: BaseException | None = None
        result: torch.Tensor | None = None
        if hook.edit_on == "all" or dist.get_rank(share) == 0:
            try:
                result = edit(target / scale) * scale if scale != 1 else edit(target)
            except Exception as exc:  # every rank must hear of it before anyone raises
                error = exc
        if hook.edit_on == "rank0":
            # a constant for autograd on every rank alike: only one rank computed it
            result = broadcast_from_root(result.detach() if result is not None else None, share, layout.device)
        self._agree(binding, failed=result is None, error=error)
        assert result is not None  # _agree raised otherwise
        if sizes is not None:
            result = result.narrow(0, sum(sizes[: layout.dp_rank]), sizes[layout.dp_rank])
        return result

    def _agree(self, binding: Binding, *, failed: bool, error: BaseException | None) -> None:
        """Raise on every rank of the stage when the edit failed on any of them."""
        layout = self.layout
        bad = agree_on_failure(failed, layout.stage_group, layout.device)
        if not bad:
            return
        ranks = dist.get_process_group_ranks(layout.stage_group)
        message = (
            f"{_WHAT}: the editing function of the hook on {binding.name!r} raised on rank(s) "
            f"{[ranks[i] for i in bad]}; every rank of the stage stops here (see the traceback of those ranks)"
        )
        if error is not None:
            error.add_note(message)
            raise error
        raise RuntimeError(message)
