"""Packing a group's tensors into one aligned flat buffer and back."""

from __future__ import annotations

import pytest
import torch

from torchsurgery.offloading.packing import ALIGNMENT, FlatLayout, pack, unpack

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
]


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).view(shape)  # arbitrary bit patterns, NaNs included


def test_pack_unpack_round_trip_is_bit_exact_for_every_dtype() -> None:
    shapes = [(3,), (2, 5), (0,), (1, 1, 7), ()]
    tensors = [_random_tensor(d, shapes[i % len(shapes)]) for i, d in enumerate(DTYPES)]
    layout = FlatLayout.of(tensors)
    buffer = pack(tensors, layout)
    assert buffer.dtype == torch.uint8 and buffer.numel() == layout.nbytes
    assert all(slot.offset % ALIGNMENT == 0 for slot in layout.slots)
    for original, view in zip(tensors, unpack(buffer, layout), strict=True):
        assert view.dtype == original.dtype and view.shape == original.shape
        assert torch.equal(view.view(torch.uint8) if view.numel() else view, original.view(torch.uint8) if original.numel() else original)
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # views, no copies


def test_pack_casts_to_the_layout_dtypes_and_refuses_mismatches() -> None:
    weights = [torch.randn(4, 4), torch.randn(4)]
    layout = FlatLayout.of(weights, [torch.bfloat16, torch.float32])
    views = unpack(pack(weights, layout), layout)
    assert views[0].dtype == torch.bfloat16 and torch.equal(views[0], weights[0].bfloat16())
    assert torch.equal(views[1], weights[1])
    with pytest.raises(ValueError, match="tensors for a layout"):
        pack(weights[:1], layout)
    with pytest.raises(ValueError, match="uint8 buffer"):
        pack(weights, layout, out=torch.empty(8, dtype=torch.uint8))


def test_one_buffer_copy_moves_the_whole_group() -> None:
    weights = [torch.randn(3, 3), torch.randn(3).half()]
    layout = FlatLayout.of(weights)
    host = pack(weights, layout)
    moved = host.clone()  # stands for the single host-to-device copy
    for a, b in zip(weights, unpack(moved, layout), strict=True):
        assert torch.equal(a, b)
