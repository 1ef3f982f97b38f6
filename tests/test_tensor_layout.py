"""The aligned tensor layout shared by offloading (one flat buffer per group) and distributed (messages)."""

from __future__ import annotations

import json

import pytest
import torch

from torchsurgery._tensor_layout import ALIGNMENT, Slot, TensorLayout, align, fill, views

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
]
SHAPES = [(3,), (2, 5), (0,), (1, 1, 7), ()]


def _random(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    count = 1
    for size in shape:
        count *= size
    raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).view(shape)  # arbitrary bit patterns, NaNs included


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


@pytest.mark.parametrize("alignment", [16, 64, ALIGNMENT])
def test_round_trip_is_bit_exact_aligned_and_viewed_in_place(alignment: int) -> None:
    tensors = [_random(d, SHAPES[i % len(SHAPES)]) for i, d in enumerate(DTYPES)]
    layout = TensorLayout.of(tensors, alignment=alignment)
    assert all(slot.offset % alignment == 0 for slot in layout.slots)
    assert all(a.end <= b.offset for a, b in zip(layout.slots, layout.slots[1:], strict=False))  # no overlap
    assert layout.nbytes == layout.slots[-1].end
    buffer = fill(torch.zeros(layout.nbytes, dtype=torch.uint8), tensors, layout)
    for original, view in zip(tensors, views(buffer, layout), strict=True):
        assert view.dtype == original.dtype and view.shape == original.shape
        assert torch.equal(_bits(view), _bits(original))
        if view.numel():
            assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view, not a copy
    # each slot's bytes are exactly the tensor's bytes, where the layout says
    for original, slot in zip(tensors, layout.slots, strict=True):
        assert torch.equal(buffer[slot.offset : slot.end], _bits(original))


def test_layout_places_tensors_by_hand_computed_offsets() -> None:
    tensors = [torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.int8)]
    layout = TensorLayout.of(tensors, alignment=16)
    assert layout.slots == (
        Slot(0, (3,), torch.float32), Slot(16, (2,), torch.bfloat16), Slot(32, (5,), torch.int8),
    )
    assert layout.nbytes == 37
    assert [align(n, 16) for n in (0, 1, 15, 16, 17)] == [0, 16, 16, 16, 32]


def test_fill_casts_to_the_layout_dtypes_like_tensor_to() -> None:
    weights = [torch.randn(4, 4), torch.randn(4)]
    layout = TensorLayout.of(weights, [torch.bfloat16, torch.float8_e4m3fn])
    out = views(fill(torch.empty(layout.nbytes, dtype=torch.uint8), weights, layout), layout)
    assert torch.equal(out[0], weights[0].to(torch.bfloat16))
    assert torch.equal(out[1].view(torch.uint8), weights[1].to(torch.float8_e4m3fn).view(torch.uint8))


def test_mismatches_are_refused() -> None:
    weights = [torch.randn(2, 2), torch.randn(3)]
    layout = TensorLayout.of(weights)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="1 tensors for a layout of 2"):
        fill(buffer, weights[:1], layout)
    with pytest.raises(ValueError, match=r"shape \(1,\) for a slot of \(3,\)"):  # copy_ would broadcast it
        fill(buffer, [weights[0], torch.ones(1)], layout)
    with pytest.raises(ValueError, match="1-d uint8 buffer"):
        views(buffer[:-1], layout)  # truncated
    with pytest.raises(ValueError, match="1-d uint8 buffer"):
        views(buffer.view(torch.int8), layout)
    with pytest.raises(ValueError, match="dtypes for"):
        TensorLayout.of(weights, [torch.float16])
    with pytest.raises(ValueError, match="alignment of 2 bytes cannot place a torch.float32"):
        TensorLayout.of(weights, alignment=2)  # the view would start inside an element


def test_offload_and_wire_use_this_layout() -> None:
    from torchsurgery.flex.parallel import _wire
    from torchsurgery.offloading import packing

    tensors = [torch.randn(3), torch.arange(5, dtype=torch.int16), torch.tensor([True, False])]
    flat = packing.FlatLayout.of(tensors)
    assert flat == TensorLayout.of(tensors, alignment=ALIGNMENT)
    packed, filled = packing.pack(tensors, flat), fill(torch.zeros(flat.nbytes, dtype=torch.uint8), tensors, flat)
    for slot in flat.slots:  # (pack leaves the padding between slots as allocated)
        assert torch.equal(packed[slot.offset : slot.end], filled[slot.offset : slot.end])

    message = _wire.pack([(str(i), t) for i, t in enumerate(tensors)], device=torch.device("cpu"))
    length = int.from_bytes(bytes(message[:8].tolist()), "little")
    header = json.loads(bytes(message[8 : 8 + length].tolist()))
    layout = TensorLayout.of(tensors, alignment=16)
    assert [entry[3] for entry in header["items"]] == [slot.offset for slot in layout.slots]
    data = message[align(8 + length, 16) :]
    assert torch.equal(data, fill(torch.zeros(layout.nbytes, dtype=torch.uint8), tensors, layout))


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator")
def test_fill_copies_host_tensors_into_a_device_buffer() -> None:
    device = torch.accelerator.current_accelerator()
    tensors = [torch.randn(5), torch.randn(2, 3).half()]
    layout = TensorLayout.of(tensors)
    buffer = fill(torch.zeros(layout.nbytes, dtype=torch.uint8, device=device), tensors, layout)
    for original, view in zip(tensors, views(buffer, layout), strict=True):
        assert view.device.type == device.type and torch.equal(view.cpu(), original)  # type: ignore[union-attr]
