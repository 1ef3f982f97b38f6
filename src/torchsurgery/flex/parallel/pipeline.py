"""Pipeline stages run one after another, activations and their gradients passed with send/recv.

With ``pipeline_parallel_size > 1`` each rank's wrapped module is its stage: the first
stage is called with the arguments given to ``FlexModel.forward``; every later stage is
called with the tensors the previous stage returned, as positional arguments. Each rank
sends to and receives from the rank at the same data- and tensor-parallel position of the
next and previous stage. The last stage's ranks return the model's output; the others
return ``None``. ``FlexModel.backward(loss)`` runs the backward the other way: the last
stage from its loss, each earlier one from the gradients of what it sent. A stage that
fails sends a failure marker instead, so the stages waiting on it raise too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchsurgery.flex.parallel import _wire
from torchsurgery.flex.parallel.layout import Layout
from torchsurgery.flex.pytree import flatten

__all__ = ["Pipeline"]

_WHAT = "torchsurgery.FlexModel"


class Pipeline:
    """This rank's stage of a pipeline, and the boundary tensors of its last forward.

    Example:
        On every rank of a two-stage layout (``stage`` holds this rank's layers)::

            pipe = Pipeline(layout)
            logits = pipe.forward(stage, (input_ids,), {})  # None except on the last stage
            pipe.backward(loss if layout.is_last_stage else None)
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._received: list[torch.Tensor] = []  # inputs from the previous stage that need grads
        self._sent: list[torch.Tensor] = []  # outputs sent on that need grads

    def _peer(self, step: int) -> int:
        layout = self.layout
        return layout.global_rank(pp=layout.pp_rank + step, dp=layout.dp_rank, tp=layout.tp_rank)

    def _receive(self, step: int, what: str) -> list[tuple[str, torch.Tensor]]:
        layout = self.layout
        status, items = _wire.unpack(_wire.recv(src=self._peer(step), group=layout.group, device=layout.device))
        if status:
            raise RuntimeError(
                f"{_WHAT}: pipeline stage {layout.pp_rank + step} failed in the {what}, so stage "
                f"{layout.pp_rank} cannot go on (see that stage's traceback)"
            )
        return items

    def _send(self, step: int, items: list[tuple[str, torch.Tensor]], *, status: int = 0) -> None:
        layout = self.layout
        _wire.send(_wire.pack(items, device=layout.device, status=status), dst=self._peer(step), group=layout.group)

    def forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Receive this stage's inputs, run it, send its outputs on; the output on the last stage."""
        layout = self.layout
        self._received, self._sent = [], []
        last = layout.is_last_stage
        sent = False
        try:
            if layout.pp_rank > 0:
                inputs = []
                for flag, tensor in self._receive(-1, "forward"):
                    tensor = tensor.clone()
                    if flag == "grad" and torch.is_grad_enabled():
                        self._received.append(tensor.requires_grad_())
                    inputs.append(tensor)
                args, kwargs = tuple(inputs), {}
            output = module(*args, **kwargs)
            if last:
                return output
            leaves, _ = flatten(output)
            if not leaves:
                raise TypeError(
                    f"{_WHAT}: pipeline stage {layout.pp_rank} returned no tensor ({type(output).__name__}); "
                    "a stage must return the tensors the next stage takes"
                )
            self._sent = [t for t in leaves if t.requires_grad]
            sent = True
            self._send(1, [("grad" if t.requires_grad else "", t) for t in leaves])
        except BaseException:
            if not last and not sent:
                self._send(1, [], status=1)
            raise
        return None

    def on_any_stage(self, found: bool) -> bool:
        """Whether ``found`` holds on some stage (every rank of the layout calls this)."""
        layout = self.layout
        if layout.pp_size == 1:
            return found
        flag = torch.tensor([int(found)], device=layout.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=layout.pp_group)
        return bool(flag.item())

    def backward(self, loss: torch.Tensor | None) -> None:
        """Backward through this stage: from ``loss`` on the last stage, else from the next stage."""
        layout = self.layout
        first = layout.pp_rank == 0
        sent = False
        try:
            if layout.is_last_stage:
                if not isinstance(loss, torch.Tensor):
                    raise TypeError(
                        f"{_WHAT}.backward: the last pipeline stage needs the loss tensor, got {type(loss).__name__}"
                    )
                loss.backward()
            else:
                grads = [t for _, t in self._receive(1, "backward")]
                if self._sent:  # nothing sent needed gradients: nothing to go back through
                    torch.autograd.backward(self._sent, grads)
            if not first:
                grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in self._received]
                sent = True
                self._send(-1, [("", g) for g in grads])
        except BaseException:
            if not first and not sent:
                self._send(-1, [], status=1)
            raise
        finally:
            self._received, self._sent = [], []
