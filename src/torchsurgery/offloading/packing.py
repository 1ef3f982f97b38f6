"""Packing a group's tensors into one flat buffer, and viewing them back out of it.

Streaming many small tensors wastes the host-to-device link; one large copy per group
does not. A :class:`FlatLayout` places each tensor at an aligned byte offset of a
``uint8`` buffer; :func:`pack` fills such a buffer and :func:`unpack` returns tensors
that are *views* into it (bit-exact, any dtype including float8), so a buffer copied to
the device in one transfer yields the device tensors without further copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGNMENT = 256  # bytes; satisfies every dtype and CUDA's preferred copy alignment


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in a flat buffer."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class FlatLayout:
    """The slots of a group's tensors and the buffer size they need.

    Example:
        >>> import torch
        >>> layout = FlatLayout.of([torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16)])
        >>> [s.offset for s in layout.slots], layout.nbytes
        ([0, 256], 260)
    """

    slots: tuple[Slot, ...]
    nbytes: int

    @staticmethod
    def of(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype] | None = None) -> FlatLayout:
        """The layout for ``tensors`` stored as ``dtypes`` (default: their own dtypes)."""
        slots, offset = [], 0
        for i, tensor in enumerate(tensors):
            dtype = dtypes[i] if dtypes is not None else tensor.dtype
            offset = -(-offset // ALIGNMENT) * ALIGNMENT
            slot = Slot(offset, tuple(tensor.shape), dtype)
            slots.append(slot)
            offset += slot.nbytes
        return FlatLayout(tuple(slots), offset)


def pack(
    tensors: Sequence[torch.Tensor], layout: FlatLayout, *, out: torch.Tensor | None = None, pin_memory: bool = False
) -> torch.Tensor:
    """Copy ``tensors`` (cast to the layout's dtypes) into one ``uint8`` buffer.

    Args:
        tensors: the tensors, in the layout's order.
        layout: from :meth:`FlatLayout.of`.
        out: a buffer to fill (at least ``layout.nbytes``); allocated on the CPU when omitted.
        pin_memory: pin the allocated buffer (for fast, asynchronous host-to-device copies).

    Returns:
        The buffer.

    Example:
        >>> import torch
        >>> tensors = [torch.arange(4.0), torch.ones(2, 2, dtype=torch.float16)]
        >>> layout = FlatLayout.of(tensors)
        >>> views = unpack(pack(tensors, layout), layout)
        >>> all(torch.equal(a, b) for a, b in zip(tensors, views))
        True
    """
    if len(tensors) != len(layout.slots):
        raise ValueError(f"torchsurgery.offload: {len(tensors)} tensors for a layout of {len(layout.slots)}")
    buffer = out if out is not None else torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pin_memory)
    if buffer.dtype != torch.uint8 or buffer.numel() < layout.nbytes:
        raise ValueError(f"torchsurgery.offload: need a uint8 buffer of {layout.nbytes} bytes")
    with torch.no_grad():
        for tensor, view in zip(tensors, unpack(buffer, layout), strict=True):
            view.copy_(tensor.detach())
    return buffer


def unpack(buffer: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
    """Views of ``buffer`` as the layout's tensors (no copy; same device as ``buffer``)."""
    views = []
    for slot in layout.slots:
        raw = buffer[slot.offset : slot.offset + slot.nbytes]
        views.append(raw.view(slot.dtype).view(slot.shape))
    return views
