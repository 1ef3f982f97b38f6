"""Where an :class:`~torchsurgery.compact.OffloadedTensor` keeps its values, and how they are read and written.

The keys of the tensor's ``__dict__`` that belong to it, and the reads and writes of its
values that need only those fields (``stored``, ``dtype``, ``device``), not the class itself.
"""

from __future__ import annotations

import torch

from torchsurgery.compact.scaled import dequantize, quantize_with

__all__ = ["STORED", "READS", "SHADOW", "COUNTER", "SCALE", "wide", "store", "written_in_place"]

# keys of an OffloadedTensor's __dict__ that belong to it; the prefix keeps them out of the
# user's attributes, which swaps carry along (torchsurgery._swap.user_attributes)
STORED, READS, SHADOW = "_torchsurgery_stored", "_torchsurgery_reads", "_torchsurgery_shadow"
COUNTER = "_torchsurgery_counter"  # the stored tensor whose version counter counts writes (see written_in_place)
# a scaled weight's fp32 scale (compact/scaled.py), broadcast to the stored values' shape: a
# view of the weight takes the same view of it, so every view reads q * scale elementwise
SCALE = "_torchsurgery_scale"


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in its dtype on its device: the stored tensor itself where it already is so."""
    stored: torch.Tensor = t.__dict__[STORED]
    scale: torch.Tensor | None = t.__dict__[SCALE]
    if scale is not None:  # a scaled weight: q * scale (compact/scaled.py), q moved narrow
        return dequantize(stored.to(t.device), scale.to(t.device), t.dtype)
    return stored.to(device=t.device, dtype=t.dtype)


def store(t: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` (read as ``t`` reads) into ``t``'s stored values: rounded to the storage dtype,
    or to a scaled weight's grid (its scale kept)."""
    stored, scale = t.__dict__[STORED], t.__dict__[SCALE]
    stored.copy_(values if scale is None else quantize_with(values.to(scale.device), scale, stored.dtype))


def written_in_place(t: torch.Tensor) -> None:
    """Count a write into ``t``'s stored values in their version counter (shared with their base).

    Below autograd, where ``__torch_dispatch__`` runs, in-place ops do not count themselves;
    copies kept by version (a master's shadow, a streamed group's slot) must see the change.
    """
    torch.autograd.graph.increment_version(t.__dict__[COUNTER])
