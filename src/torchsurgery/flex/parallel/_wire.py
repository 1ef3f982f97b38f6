"""Named tensors packed into one byte buffer, and sent between ranks as one message.

Captures shipped to rank 0 and activations passed between pipeline stages travel as a
single ``uint8`` tensor: the header's length (8 bytes), a JSON header (status; names,
dtypes, shapes, offsets) and then the tensors in the library's aligned layout
(:mod:`torchsurgery._tensor_layout`, 16-byte alignment), so the receiver views each tensor in
place. JSON, not pickle: nothing a peer sends is ever executed.

Hand-written rather than safetensors: the message is built on the sending device so one
collective ships it with no host round trip, and safetensors' ``save`` returns host bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
import torch.distributed as dist

from torchsurgery._tensor_layout import Slot, TensorLayout, align, fill, views
from torchsurgery._validate import dtype_from_name, dtype_name

_ALIGN = 16
_LENGTH = 8  # bytes of the header's length, before the header


def pack(items: Sequence[tuple[str, torch.Tensor]], *, device: torch.device, status: int = 0) -> torch.Tensor:
    """One ``uint8`` buffer on ``device`` holding ``items`` and a status code.

    Example:
        >>> buf = pack([("a", torch.arange(3.0))], device=torch.device("cpu"))
        >>> status, items = unpack(buf)
        >>> status, items[0][0], items[0][1].tolist()
        (0, 'a', [0.0, 1.0, 2.0])
    """
    for name, tensor in items:
        if dtype_from_name(dtype_name(tensor.dtype)) is None:
            raise TypeError(f"torchsurgery.flex.parallel: cannot send a {tensor.dtype} tensor ({name!r})")
    tensors = [tensor for _, tensor in items]
    layout = TensorLayout.of(tensors, alignment=_ALIGN)
    entries = [
        [name, dtype_name(slot.dtype), list(slot.shape), slot.offset]
        for (name, _), slot in zip(items, layout.slots, strict=True)
    ]
    header = json.dumps({"status": status, "items": entries}).encode()
    start = align(_LENGTH + len(header), _ALIGN)
    buffer = torch.zeros(start + layout.nbytes, dtype=torch.uint8, device=device)
    head = torch.frombuffer(bytearray(len(header).to_bytes(_LENGTH, "little") + header), dtype=torch.uint8)
    buffer[: head.numel()] = head.to(device)
    fill(buffer[start:], tensors, layout)
    return buffer


def unpack(buffer: torch.Tensor) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """The status and named tensors of a :func:`pack` buffer (views into it)."""
    length = int.from_bytes(bytes(buffer[:_LENGTH].cpu().tolist()), "little")
    header = json.loads(bytes(buffer[_LENGTH : _LENGTH + length].cpu().tolist()).decode())
    names, slots = [], []
    for name, code, shape, offset in header["items"]:
        dtype = dtype_from_name(code)
        if dtype is None:
            raise ValueError(f"torchsurgery.flex.parallel: a received buffer names an unknown dtype {code!r}")
        names.append(name)
        slots.append(Slot(offset, tuple(shape), dtype))
    layout = TensorLayout(tuple(slots), max((slot.end for slot in slots), default=0))
    tensors = views(buffer[align(_LENGTH + length, _ALIGN) :], layout)
    return int(header["status"]), list(zip(names, tensors, strict=True))


def send(buffer: torch.Tensor, *, dst: int, group: dist.ProcessGroup) -> None:
    """Send a buffer (length first) to the global rank ``dst`` over ``group``."""
    dist.send(torch.tensor([buffer.numel()], dtype=torch.int64, device=buffer.device), dst=dst, group=group)
    dist.send(buffer, dst=dst, group=group)


def recv(*, src: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """Receive a buffer sent by :func:`send` from the global rank ``src``."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src=src, group=group)
    buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(buffer, src=src, group=group)
    return buffer


# Framed messages. A sender that talks to the same receiver every pass (captures shipped
# to rank 0) sends one frame of ``FRAME_HEAD + capacity`` bytes: a head (status, size) and
# the data when it fits. Data that does not fit follows in a second message, and both ends
# then adopt the new capacity by the same rule, so the next pass needs one message again.
FRAME_HEAD = 16


def next_capacity(capacity: int, size: int) -> int:
    """The capacity both ends use after a pass that carried ``size`` bytes."""
    return size if size > capacity or size < capacity // 4 else capacity


def frame(data: torch.Tensor | None, *, status: int, capacity: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first message (head and, if it fits, ``data``) and the overflow message, if any.

    Example:
        >>> first, rest = frame(torch.arange(3, dtype=torch.uint8), status=0, capacity=8, device=torch.device("cpu"))
        >>> read_head(first), rest is None, first[FRAME_HEAD:FRAME_HEAD + 3].tolist()
        ((0, 3), True, [0, 1, 2])
    """
    size = 0 if data is None else data.numel()
    first = torch.zeros(FRAME_HEAD + capacity, dtype=torch.uint8, device=device)
    first[:FRAME_HEAD].view(torch.int64).copy_(torch.tensor([status, size]))
    if data is not None and size <= capacity:
        first[FRAME_HEAD : FRAME_HEAD + size] = data
        return first, None
    return first, data


def read_head(first: torch.Tensor) -> tuple[int, int]:
    """``(status, size)`` of a frame."""
    status, size = first[:FRAME_HEAD].view(torch.int64).tolist()
    return int(status), int(size)
