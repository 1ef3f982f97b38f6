"""A streamed group's weights in one flat host buffer, and their views back out of it.

Streaming many small tensors wastes the host-to-device link; one large copy per group
does not. The layout is the library's aligned tensor layout (:mod:`torchsurgery._tensor_layout`)
at 256-byte alignment: :func:`pack` fills a (possibly pinned) host buffer and
:func:`unpack` returns tensors that are *views* into a buffer (bit-exact, any dtype
including float8), so a buffer copied to the device in one transfer yields the device
tensors without further copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchsurgery._tensor_layout import ALIGNMENT, Slot, TensorLayout, fill, views

FlatLayout = TensorLayout
"""The slots of a group's weights and the buffer size they need (see :class:`~torchsurgery._tensor_layout.TensorLayout`)."""


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

    Raises:
        ValueError: as many tensors as the layout has slots are needed, and ``out`` must
            be a ``uint8`` buffer large enough.

    Example:
        >>> import torch
        >>> tensors = [torch.arange(4.0), torch.ones(2, 2, dtype=torch.float16)]
        >>> layout = FlatLayout.of(tensors)
        >>> views = unpack(pack(tensors, layout), layout)
        >>> all(torch.equal(a, b) for a, b in zip(tensors, views))
        True
    """
    if len(tensors) != len(layout.slots):  # checked before a (pinned) buffer is allocated for nothing
        raise ValueError(f"torchsurgery.offload: {len(tensors)} tensors for a layout of {len(layout.slots)}")
    buffer = out if out is not None else torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pin_memory)
    return fill(buffer, tensors, layout)


def unpack(buffer: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
    """Views of ``buffer`` as the layout's tensors (no copy; same device as ``buffer``).

    Example:
        >>> layout = FlatLayout.of([torch.zeros(2, dtype=torch.float16)])
        >>> unpack(torch.zeros(layout.nbytes, dtype=torch.uint8), layout)[0].dtype
        torch.float16
    """
    return views(buffer, layout)


__all__ = ["ALIGNMENT", "FlatLayout", "Slot", "pack", "unpack"]
