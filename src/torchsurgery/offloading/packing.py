"""A streamed group's weights in flat buffers, and their views back out of them.

Streaming many small tensors wastes the host-to-device link; one large copy per group
does not. The layout is the library's aligned tensor layout (:mod:`torchsurgery._tensor_layout`)
at 256-byte alignment: :func:`pack` fills a (possibly pinned) buffer and :func:`unpack`
returns tensors that are *views* into a buffer (bit-exact, any dtype including float8),
so a buffer copied to the device in one transfer yields the device tensors without
further copies.

On the host a group keeps one buffer per *dtype run* (consecutive slots of one dtype,
:func:`dtype_runs`; :func:`pack_runs` fills them): the parameters are views of those
buffers, and tensors of different dtypes never share memory, which ``torch.save`` refuses
to save. The device slot holds the whole layout; each run is one copy into it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def dtype_runs(layout: FlatLayout) -> list[tuple[int, int]]:
    """``[first, end)`` slot indices of each run of consecutive slots of one dtype.

    Example:
        >>> layout = FlatLayout.of([torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.int8)])
        >>> dtype_runs(layout)
        [(0, 2), (2, 3)]
    """
    runs: list[tuple[int, int]] = []
    for i, slot in enumerate(layout.slots):
        if runs and layout.slots[runs[-1][0]].dtype == slot.dtype:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def run_bytes(layout: FlatLayout, first: int, end: int) -> tuple[int, int]:
    """The byte range ``[start, stop)`` of slots ``first`` to ``end`` in the layout's buffer."""
    return layout.slots[first].offset, layout.slots[end - 1].end


def pack_runs(
    tensors: Sequence[torch.Tensor], layout: FlatLayout, allocate: Callable[[int], torch.Tensor]
) -> list[torch.Tensor]:
    """Copy ``tensors`` into one new ``uint8`` buffer per dtype run; their views, in layout order.

    ``allocate(nbytes)`` makes each buffer (pinned for an accelerator). A view sits at the
    same offset from its run's start as its slot does in the layout, so a run's buffer is
    copied into a device slot in one piece.

    Example:
        >>> tensors = [torch.arange(3.0), torch.ones(2, dtype=torch.float16)]
        >>> views = pack_runs(tensors, FlatLayout.of(tensors), lambda n: torch.empty(n, dtype=torch.uint8))
        >>> [v.dtype for v in views], views[0].untyped_storage().data_ptr() != views[1].untyped_storage().data_ptr()
        ([torch.float32, torch.float16], True)
    """
    if len(tensors) != len(layout.slots):
        raise ValueError(f"torchsurgery.offload: {len(tensors)} tensors for a layout of {len(layout.slots)}")
    out: list[torch.Tensor] = []
    for first, end in dtype_runs(layout):
        start, stop = run_bytes(layout, first, end)
        run = TensorLayout(tuple(Slot(s.offset - start, s.shape, s.dtype) for s in layout.slots[first:end]), stop - start)
        out += views(fill(allocate(run.nbytes), tensors[first:end], run), run)
    return out


__all__ = ["ALIGNMENT", "FlatLayout", "Slot", "dtype_runs", "pack", "pack_runs", "run_bytes", "unpack"]
