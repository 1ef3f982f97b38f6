"""Tensors at aligned byte offsets of one ``uint8`` buffer: the layout, filling it, views back out.

One large copy moves many tensors faster than many small ones, between host and device
or between ranks. A :class:`TensorLayout` places each tensor (its shape and dtype) at a
byte offset rounded up to the layout's alignment; :func:`fill` copies tensors into such
a buffer, casting to the layout's dtypes, and :func:`views` returns tensors that are
*views* into it (bit-exact for every dtype, float8 and bool included), on the buffer's
device, without copying. The offload engine packs a group's weights this way; the
distributed code sends named tensors this way, after a header.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGNMENT = 256
"""The default alignment in bytes: every dtype's, and the one CUDA copies prefer."""


def align(offset: int, alignment: int) -> int:
    """``offset`` rounded up to a multiple of ``alignment``.

    Example:
        >>> align(0, 16), align(1, 16), align(32, 16)
        (0, 16, 32)
    """
    return -(-offset // alignment) * alignment


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in a buffer: its byte offset, shape and dtype.

    Example:
        >>> Slot(256, (2, 3), torch.bfloat16).nbytes
        12
    """

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def end(self) -> int:
        """The byte just past the tensor."""
        return self.offset + self.nbytes


@dataclass(frozen=True)
class TensorLayout:
    """The slots of some tensors and the buffer size they need.

    Attributes:
        slots: one per tensor, in order, each at an aligned offset.
        nbytes: the buffer size: the end of the last slot (no padding after it).

    Example:
        >>> layout = TensorLayout.of([torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16)])
        >>> [s.offset for s in layout.slots], layout.nbytes
        ([0, 256], 260)
        >>> TensorLayout.of([torch.zeros(3), torch.zeros(2)], alignment=16).nbytes
        24
    """

    slots: tuple[Slot, ...]
    nbytes: int

    @classmethod
    def of(
        cls,
        tensors: Sequence[torch.Tensor],
        dtypes: Sequence[torch.dtype] | None = None,
        *,
        alignment: int = ALIGNMENT,
    ) -> TensorLayout:
        """The layout for ``tensors`` stored as ``dtypes`` (default: their own), each aligned to ``alignment`` bytes.

        ``alignment`` must be a multiple of every dtype's item size, so each view starts on an element.
        """
        if dtypes is not None and len(dtypes) != len(tensors):
            raise ValueError(f"torchsurgery: {len(dtypes)} dtypes for {len(tensors)} tensors")
        slots: list[Slot] = []
        end = 0
        for i, tensor in enumerate(tensors):
            dtype = dtypes[i] if dtypes is not None else tensor.dtype
            if alignment % dtype.itemsize:
                raise ValueError(f"torchsurgery: an alignment of {alignment} bytes cannot place a {dtype} tensor")
            slot = Slot(align(end, alignment), tuple(tensor.shape), dtype)
            slots.append(slot)
            end = slot.end
        return cls(tuple(slots), end)


def views(buffer: torch.Tensor, layout: TensorLayout) -> list[torch.Tensor]:
    """The layout's tensors as views of ``buffer`` (no copy; on ``buffer``'s device).

    Raises:
        ValueError: ``buffer`` is not a 1-d ``uint8`` tensor of at least ``layout.nbytes``
            bytes (a truncated or foreign buffer).

    Example:
        >>> layout = TensorLayout.of([torch.zeros(2)])
        >>> buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
        >>> views(buffer, layout)[0].fill_(1.5)
        tensor([1.5000, 1.5000])
        >>> buffer[:4].view(torch.float32)
        tensor([1.5000])
    """
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < layout.nbytes:
        raise ValueError(
            f"torchsurgery: the tensors need a 1-d uint8 buffer of {layout.nbytes} bytes, "
            f"got {buffer.dtype} of shape {tuple(buffer.shape)}"
        )
    return [buffer[slot.offset : slot.end].view(slot.dtype).view(slot.shape) for slot in layout.slots]


def fill(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], layout: TensorLayout) -> torch.Tensor:
    """Copy ``tensors`` (cast to the layout's dtypes, from any device) into ``buffer``; returns ``buffer``.

    Bytes between slots are left as they were.

    Example:
        >>> tensors = [torch.arange(4.0), torch.tensor([True, False])]
        >>> layout = TensorLayout.of(tensors, alignment=16)
        >>> buffer = fill(torch.zeros(layout.nbytes, dtype=torch.uint8), tensors, layout)
        >>> [t.tolist() for t in views(buffer, layout)]
        [[0.0, 1.0, 2.0, 3.0], [True, False]]
    """
    if len(tensors) != len(layout.slots):
        raise ValueError(f"torchsurgery: {len(tensors)} tensors for a layout of {len(layout.slots)}")
    with torch.no_grad():
        for tensor, view in zip(tensors, views(buffer, layout), strict=True):
            if tensor.shape != view.shape:  # copy_ would broadcast it
                raise ValueError(f"torchsurgery: a tensor of shape {tuple(tensor.shape)} for a slot of {tuple(view.shape)}")
            view.copy_(tensor.detach())
    return buffer
