"""Captures shipped to the ranks that hold ``output_ptr``: every rank, or the layout's first.

With one replica and one stage, captures go straight to ``output_ptr``: on the first
tensor-parallel rank, or on each of them for every rank (each keeps its own copy of the
whole activation, which it has or gathers). Otherwise the first tensor-parallel rank of
each replica and stage (a *sender*) keeps a CPU copy of every capture, and at the end of
the forward (or of the backward, for gradient hooks) the captures of the pass travel
once, in one buffer per sender:

- ``captures_on="every_rank"`` (the default, where flex_model has them): every rank
  all-gathers one frame per rank, a fixed head (failed?, size) and as many capture bytes
  as the frames hold; a sender whose captures do not fit broadcasts them next. Every rank
  sees every size and adopts the same next capacity
  (:func:`~torchsurgery.flex.parallel._wire.next_capacity`), so after the first pass one
  all-gather carries a pass. Every rank merges the same pieces the same way, so every
  ``output_ptr`` ends up with the same captures.
- ``captures_on="first_rank"``: each sender sends rank 0 one frame, its capacity grown
  alike on both sides from the sizes seen, so after the first pass a frame arrives in one
  message; a bigger one follows in a second. Point to point only: the other ranks never
  wait for one another here.

Merging: the data-parallel pieces of a key are concatenated along the batch dimension
(sizes may differ) and each stage's keys are added in stage order. A parameter's
gradient (``register_hook``) has no batch dimension: the replicas' gradients are
averaged, as DDP averages them; each capture travels under a name that says which
(``cat:`` or ``mean:``), since a rank of another stage cannot know which keys name
parameters. Activation gradients are divided by the data-parallel size (see
:func:`~torchsurgery.flex.parallel.edits.replica_scale`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from torchsurgery.flex.captures import Captures, OutputPtr
from torchsurgery.flex.hook_function import Binding
from torchsurgery.flex.parallel import _wire
from torchsurgery.flex.parallel.edits import replica_scale
from torchsurgery.flex.parallel.layout import Layout

__all__ = ["CaptureShipping"]

_WHAT = "torchsurgery.FlexModel"


def _receive_all(into: list[tuple[torch.Tensor, int]], group: dist.ProcessGroup) -> None:
    """Receive into each tensor from its global rank, all at once."""
    works = [dist.irecv(tensor, src=rank, group=group) for tensor, rank in into]
    for work in works:
        if work is not None:  # None only for ranks outside the group, which none are
            work.wait()


def _named(pending: OutputPtr, averaged: set[str]) -> list[tuple[str, torch.Tensor]]:
    """The captures as they travel: each name says how the replicas' pieces join."""
    return [(f"{'mean' if key in averaged else 'cat'}:{key}", t) for key, values in pending.items() for t in values]


def _part(items: list[tuple[str, torch.Tensor]], averaged: set[str]) -> OutputPtr:
    """A sender's captures from what travelled (keys of parameter gradients added to ``averaged``)."""
    part: OutputPtr = {}
    for name, tensor in items:
        join, key = name.split(":", 1)
        if join == "mean":
            averaged.add(key)
        # views of a buffer received for this pass alone: no copy needed on a CPU
        part.setdefault(key, []).append(tensor.cpu())
    return part


class CaptureShipping:
    """This rank's captures of a pass, and their way to the ranks that hold ``output_ptr``.

    Args:
        layout: this rank's place in the layout and its groups.
        every_rank: deliver to every rank of the layout (else to its first rank alone).

    Example:
        On every rank, for each hook call and once per pass::

            shipping = CaptureShipping(layout)
            shipping.keep(captures, binding, full)   # on the first tensor-parallel rank
            shipping.ship(captures.output_ptr, failed=False)
    """

    def __init__(self, layout: Layout, *, every_rank: bool = True) -> None:
        self.layout = layout
        self.every_rank = every_rank
        # one replica, one stage: captures go straight to output_ptr, no message needed
        self.direct = layout.dp_size == 1 and layout.pp_size == 1
        # ... and, for every rank, each tensor-parallel rank keeps its own (whole) copy
        self.every_tp_rank = self.direct and every_rank
        self._pending: OutputPtr = {}
        self._averaged: set[str] = set()  # parameter-gradient keys: the replicas' pieces are averaged
        self._sends: list[tuple[Any, torch.Tensor]] = []
        # frame capacity per sender position (rank 0 keeps every sender's; a sender its own at 0)
        self._capacity: dict[int, int] = dict.fromkeys(range(len(layout.ranks)), 0)
        self._shared_capacity = 0  # every rank's frame capacity, delivering to every rank
        self._after_backward = False  # a ship is queued for the end of the running backward

    def keep(self, captures: Captures, binding: Binding, full: torch.Tensor) -> None:
        """Keep ``full`` as this rank's capture for ``binding`` (shipped at the end of the pass)."""
        if binding.hook_type == "tensor":
            self._averaged.add(binding.key)
        scale = replica_scale(self.layout, binding.hook_type)
        if scale != 1:
            full = full / scale
        captures.capture(binding.key, full, None if self.direct else self._pending)

    def ship_after_backward(self, captures: Captures) -> None:
        """Ship when the running autograd backward ends, on every rank alike (once per backward)."""
        if self.direct or self._after_backward:
            return
        self._after_backward = True
        callback = functools.partial(self._ship_queued, captures)
        torch.autograd.Variable._execution_engine.queue_callback(callback)

    def _ship_queued(self, captures: Captures) -> None:
        self._after_backward = False
        self.ship(captures.output_ptr, failed=False)

    def new_pass(self) -> None:
        """A forward starts: a backward callback queued but never run is forgotten."""
        self._after_backward = False

    def ship(self, output_ptr: OutputPtr, *, failed: bool) -> None:
        """Deliver this pass's captures: add everyone's to ``output_ptr`` where it is held.

        Every rank of the layout calls this once per pass.

        Raises:
            RuntimeError: on the ranks that hold ``output_ptr`` and did not fail, when
                another rank failed in this pass (it is named).
        """
        if self.direct:
            return
        pending, self._pending = self._pending, {}
        if self.every_rank:
            self._finish(output_ptr, self._exchange(pending, failed), failed)
        elif self.layout.is_root:
            self._finish(output_ptr, {0: (int(failed), pending), **self._receive()}, failed)
        elif self.layout.tp_rank == 0:
            self._send(pending, failed)

    def _finish(self, output_ptr: OutputPtr, received: dict[int, tuple[int, OutputPtr]], failed: bool) -> None:
        if failed:
            return  # this rank's own exception is already on its way
        bad = [self.layout.ranks[p] for p, (status, _) in received.items() if status]
        if bad:
            raise RuntimeError(
                f"{_WHAT}: rank(s) {bad} failed in this pass, so their captures are missing; "
                "see the traceback of those ranks"
            )
        self._merge(output_ptr, {p: part for p, (_, part) in received.items()})

    def _exchange(self, pending: OutputPtr, failed: bool) -> dict[int, tuple[int, OutputPtr]]:
        """Every rank's (status, captures), by position: one all-gather of equal frames, then
        a broadcast for each sender whose captures outgrew them."""
        layout, device = self.layout, self.layout.device
        items = _named(pending, self._averaged) if layout.tp_rank == 0 and not failed else []
        data = _wire.pack(items, device=device) if items else None
        capacity = self._shared_capacity
        first, rest = _wire.frame(data, status=int(failed), capacity=capacity, device=device)
        frames = [torch.empty_like(first) for _ in layout.ranks]
        dist.all_gather(frames, first, group=layout.group)
        heads = [_wire.read_head(frame) for frame in frames]
        received: dict[int, tuple[int, OutputPtr]] = {}
        for p, (status, size) in enumerate(heads):
            part: OutputPtr = {}
            if p == layout.position:
                part = pending
                if rest is not None:
                    dist.broadcast(rest, group_src=p, group=layout.group)
            elif size:
                if size > capacity:
                    buffer = torch.empty(size, dtype=torch.uint8, device=device)
                    dist.broadcast(buffer, group_src=p, group=layout.group)
                else:
                    buffer = frames[p][_wire.FRAME_HEAD : _wire.FRAME_HEAD + size]
                part = _part(_wire.unpack(buffer)[1], self._averaged)
            received[p] = (status, part)
        # every rank saw every size: they all adopt the same capacity
        self._shared_capacity = _wire.next_capacity(capacity, max(size for _, size in heads))
        return received

    def _send(self, pending: OutputPtr, failed: bool) -> None:
        layout, device = self.layout, self.layout.device
        items = _named(pending, self._averaged)
        data = _wire.pack(items, device=device) if items and not failed else None
        first, rest = _wire.frame(data, status=int(failed), capacity=self._capacity[0], device=device)
        self._capacity[0] = _wire.next_capacity(self._capacity[0], 0 if data is None else data.numel())
        self.settle()
        # not waited for here: this rank goes on while rank 0 receives
        self._sends = [(dist.isend(t, dst=layout.ranks[0], group=layout.group), t) for t in (first, rest) if t is not None]

    def _receive(self) -> dict[int, tuple[int, OutputPtr]]:
        """Every sender's (status, captures), by its position in the layout."""
        layout, device = self.layout, self.layout.device
        senders = [(p, layout.ranks[p]) for p in range(layout.tp_size, len(layout.ranks), layout.tp_size)]
        firsts = {p: torch.empty(_wire.FRAME_HEAD + self._capacity[p], dtype=torch.uint8, device=device) for p, _ in senders}
        _receive_all([(firsts[p], rank) for p, rank in senders], layout.group)
        heads = {p: _wire.read_head(firsts[p]) for p, _ in senders}
        overflow = {p: torch.empty(size, dtype=torch.uint8, device=device) for p, (_, size) in heads.items() if size > self._capacity[p]}
        # always drained, so the next pass starts with nothing in flight
        _receive_all([(overflow[p], rank) for p, rank in senders if p in overflow], layout.group)
        received: dict[int, tuple[int, OutputPtr]] = {}
        for p, (status, size) in heads.items():
            part: OutputPtr = {}
            if size:
                buffer = overflow.get(p, firsts[p][_wire.FRAME_HEAD : _wire.FRAME_HEAD + size])
                part = _part(_wire.unpack(buffer)[1], self._averaged)
            self._capacity[p] = _wire.next_capacity(self._capacity[p], size)
            received[p] = (status, part)
        return received

    def _merge(self, output_ptr: OutputPtr, received: dict[int, OutputPtr]) -> None:
        """Stage by stage, each key's replica pieces joined into one capture per call."""
        layout = self.layout
        for stage in range(layout.pp_size):
            replicas = [received.get((stage * layout.dp_size + d) * layout.tp_size, {}) for d in range(layout.dp_size)]
            keys: dict[str, None] = {}
            for part in replicas:
                keys.update(dict.fromkeys(part))
            for key in keys:
                count = max(len(part.get(key, ())) for part in replicas)
                for i in range(count):
                    pieces = [part[key][i] for part in replicas if i < len(part.get(key, ()))]
                    if len(pieces) == 1:
                        value = pieces[0]
                    elif key in self._averaged:
                        value = torch.stack(pieces).sum(0) / layout.dp_size
                    else:
                        value = torch.cat(pieces)
                    output_ptr.setdefault(key, []).append(value)

    def settle(self) -> None:
        """Wait for the previous pass's sends (their tensors stay alive until then)."""
        for work, _ in self._sends:
            if work is not None:
                work.wait()
        self._sends = []
