"""Packing named tensors into one byte buffer and back."""

from __future__ import annotations

import pytest
import torch

from torchsurgery.flex.parallel._wire import pack, unpack

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool]
)
def test_round_trip_keeps_names_values_dtypes_and_shapes(dtype: torch.dtype) -> None:
    items = [
        ("a", (torch.randn(3, 5) * 10).to(dtype)),
        ("a", torch.ones(()).to(dtype)),  # a second value under the same name, 0-dim
        ("b.c", torch.zeros(0, 4).to(dtype)),  # empty
        ("d", (torch.randn(7) * 10).to(dtype)),  # odd byte count before the next tensor
        ("e", torch.arange(6).reshape(2, 3).t().to(dtype)),  # not contiguous
    ]
    status, back = unpack(pack(items, device=CPU, status=0))
    assert status == 0
    assert [name for name, _ in back] == [name for name, _ in items]
    for (_, want), (_, got) in zip(items, back, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_status_travels_without_tensors() -> None:
    assert unpack(pack([], device=CPU, status=1)) == (1, [])


def test_an_unsupported_dtype_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="'q'"):
        pack([("q", torch.zeros(2, dtype=torch.float8_e4m3fnuz))], device=CPU)


def test_frames_carry_data_that_fits_and_signal_what_does_not() -> None:
    from torchsurgery.flex.parallel._wire import FRAME_HEAD, frame, next_capacity, read_head

    data = torch.arange(10, dtype=torch.uint8)
    first, rest = frame(data, status=0, capacity=16, device=CPU)
    assert rest is None and first.numel() == FRAME_HEAD + 16
    assert read_head(first) == (0, 10) and torch.equal(first[FRAME_HEAD : FRAME_HEAD + 10], data)
    first, rest = frame(data, status=1, capacity=4, device=CPU)  # too big: follows on its own
    assert read_head(first) == (1, 10) and rest is data
    # both ends move to the same capacity: grow to fit, shrink when far too big, else keep
    assert [next_capacity(4, 10), next_capacity(16, 10), next_capacity(64, 10)] == [10, 16, 10]
