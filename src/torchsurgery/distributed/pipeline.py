"""Pipeline stages run one after another, activations passed with send/recv.

With ``pipeline_parallel_size > 1`` each rank's wrapped module is its stage: the first
stage is called with the arguments given to ``FlexModel.forward``; every later stage is
called with the tensors the previous stage returned, as positional arguments. Each rank
sends to and receives from the rank at the same data- and tensor-parallel position of the
next and previous stage. The last stage's ranks return the model's output; the others
return ``None``. A stage that fails sends a failure marker instead of its activations,
so the later stages raise too instead of waiting.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from torchsurgery.distributed import _wire
from torchsurgery.distributed.layout import Layout
from torchsurgery.flex._pytree import flatten

__all__ = ["run_stage"]


def run_stage(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], layout: Layout) -> Any:
    """Run this rank's stage: receive its inputs, run it, send its outputs on.

    Example:
        Run on every rank of a two-stage layout (``stage`` holds this rank's layers)::

            out = run_stage(stage, (input_ids,), {}, layout)  # the logits on the last stage
    """
    if layout.pp_size == 1:
        return module(*args, **kwargs)
    here = {"dp": layout.dp_rank, "tp": layout.tp_rank}
    group, device = layout.group, layout.device
    last = layout.is_last_stage
    nxt = layout.global_rank(pp=min(layout.pp_rank + 1, layout.pp_size - 1), **here)
    sent = False
    try:
        if layout.pp_rank > 0:
            status, items = _wire.unpack(
                _wire.recv(src=layout.global_rank(pp=layout.pp_rank - 1, **here), group=group, device=device)
            )
            if status:
                raise RuntimeError(
                    f"torchsurgery.FlexModel: pipeline stage {layout.pp_rank - 1} failed, so stage "
                    f"{layout.pp_rank} cannot run (see that stage's traceback)"
                )
            args, kwargs = tuple(t.clone() for _, t in items), {}
        output = module(*args, **kwargs)
        if last:
            return output
        leaves, _ = flatten(output)
        if not leaves:
            raise TypeError(
                f"torchsurgery.FlexModel: pipeline stage {layout.pp_rank} returned no tensor "
                f"({type(output).__name__}); a stage must return the tensors the next stage takes"
            )
        packed = _wire.pack([(str(i), t) for i, t in enumerate(leaves)], device=device)
        sent = True
        _wire.send(packed, dst=nxt, group=group)
    except BaseException:
        if not last and not sent:
            _wire.send(_wire.pack([], device=device, status=1), dst=nxt, group=group)
        raise
    return None
