"""The shared argument checks accept what PyTorch accepts and refuse the rest with a typed error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from torchsurgery._validate import (
    DTYPES,
    STORAGE_DTYPES,
    check_bytes,
    check_device,
    check_dtype,
    check_storage_dtype,
    dtype_from_name,
    dtype_from_safetensors,
    dtype_name,
    holds_exactly,
    safetensors_code,
)
from torchsurgery.errors import ArgumentTypeError, ArgumentValueError, Setting

ALL_DTYPES = [v for v in vars(torch).values() if isinstance(v, torch.dtype)]


@pytest.mark.parametrize("dtype", sorted(set(ALL_DTYPES), key=str), ids=str)
def test_check_dtype_accepts_what_module_to_accepts(dtype: torch.dtype) -> None:
    # nn.Module.to takes floating point and complex dtypes only; offload and friends take the floating ones
    try:
        nn.Linear(1, 1).to(dtype)
        module_takes = True
    except (TypeError, RuntimeError, NotImplementedError):  # an integer dtype; a packed one nothing casts to
        module_takes = False
    if module_takes:
        assert check_dtype(dtype, "f", complex_ok=True) is dtype
    else:
        with pytest.raises(ArgumentValueError) as refused:
            check_dtype(dtype, "f", complex_ok=True)
        assert (refused.value.arg, refused.value.value) == ("dtype", dtype)
    if dtype.is_floating_point and module_takes:
        assert check_dtype(dtype, "f") is dtype
    else:
        with pytest.raises(ArgumentValueError, match=f"f: storage_dtype must be a floating point dtype.*got {dtype}"):
            check_dtype(dtype, "f", "storage_dtype")


@pytest.mark.parametrize("value", ["bf16", "float32", 16, torch.zeros(1)], ids=repr)
def test_check_dtype_refuses_what_is_not_a_dtype(value: Any) -> None:
    with pytest.raises(ArgumentTypeError) as refused:
        check_dtype(value, "f", "master_dtype")
    assert refused.value.arg == "master_dtype" and refused.value.value is value
    assert check_dtype(None, "f") is None


def _converts_and_back(dtype: torch.dtype) -> bool:
    """Whether weights (signed values with a fraction) survive a trip through ``dtype`` up to its rounding."""
    w = torch.tensor([-1.5, -0.375, 0.0, 0.3, 1.25, 3.0])
    try:
        once = w.to(dtype).to(torch.float32)
        twice = once.to(dtype).to(torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return bool((once.sign() == w.sign()).all()) and torch.equal(once, twice) and len(set(once.tolist())) == len(w)


@pytest.mark.parametrize("value", sorted(set(ALL_DTYPES), key=str) + ["bf16", float, 16], ids=str)
def test_check_storage_dtype_takes_the_dtypes_weights_convert_to_and_back_and_checkpoints_name(value: Any) -> None:
    expected = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
    assert list(STORAGE_DTYPES) == expected
    if value in expected:
        assert _converts_and_back(value) and safetensors_code(value) is not None
        assert check_storage_dtype(value, "f", "master_dtype") is value
        return
    if isinstance(value, torch.dtype) and value in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        assert _converts_and_back(value) and safetensors_code(value) is None  # they convert: refused as unnamed
    elif isinstance(value, torch.dtype) and value.is_floating_point:
        assert not _converts_and_back(value)  # e8m0 has no sign nor mantissa; nothing casts to fp4
    with pytest.raises(ArgumentTypeError) as refused:
        check_storage_dtype(value, "f", "master_dtype")
    error = refused.value
    assert (error.what, error.arg, error.value) == ("f", "master_dtype", value)
    assert str(error).endswith(f"got {value!r}") and all(str(d) in str(error) for d in expected)
    assert check_storage_dtype(None, "f") is None


def _every_value(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an 8- or 16-bit floating dtype."""
    bits = torch.arange(2 ** (8 * dtype.itemsize), dtype=torch.int32)
    values = (bits.to(torch.uint8) if dtype.itemsize == 1 else bits.to(torch.int16)).view(dtype).to(torch.float64)
    return values[values.isfinite()]


@pytest.mark.parametrize("narrow", STORAGE_DTYPES, ids=str)
@pytest.mark.parametrize("wide", STORAGE_DTYPES, ids=str)
def test_holds_exactly_is_whether_every_value_survives_the_conversion(wide: torch.dtype, narrow: torch.dtype) -> None:
    if narrow.itemsize <= 2:
        values = _every_value(narrow)
    else:  # too many to list: the extremes and the finest step
        info = torch.finfo(narrow)
        values = torch.tensor([info.max, -info.max, info.smallest_normal * info.eps, 1 + info.eps], dtype=torch.float64)
    survive = torch.equal(values.to(wide).to(torch.float64), values)
    assert holds_exactly(wide, narrow) == survive


def _torch_device(value: Any) -> torch.device | None:
    try:
        return torch.device(value)
    except (RuntimeError, TypeError):
        return None


@pytest.mark.parametrize("value", ["cpu", "cpu:0", "meta", torch.device("cpu"), "CPU", "tpu", "", "cuda", "cuda:0",
                                   "xpu:1", "mps"], ids=repr)
def test_check_device_accepts_devices_torch_parses_and_this_machine_has(value: Any) -> None:
    parsed = _torch_device(value)
    exists = parsed is not None and (
        parsed.type in ("cpu", "meta")
        or (torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == parsed.type  # type: ignore[union-attr]
            and (parsed.index is None or parsed.index < torch.accelerator.device_count()))
    )
    if exists:
        assert check_device(value, "f") == parsed
        return
    with pytest.raises(ArgumentValueError) as refused:
        check_device(value, "f")
    error = refused.value
    assert (error.what, error.arg, error.value) == ("f", "device", value)
    if parsed is None:
        assert error.problem.startswith(f"{value!r} is not a device (") and error.setting is None
    else:
        assert error.setting == Setting("device", "cpu")  # the fix names a device that exists


def test_check_bytes() -> None:
    assert check_bytes(0, "f", "budget") == 0 and check_bytes(1 << 40, "f", "budget") == 1 << 40
    assert check_bytes(None, "f", "budget") is None
    for wrong in (True, 1.5, "1MB"):
        with pytest.raises(ArgumentTypeError):
            check_bytes(wrong, "f", "budget")
    with pytest.raises(ArgumentValueError, match=r"f: keep_free must be a number of bytes \(int >= 0\) or None, got -1"):
        check_bytes(-1, "f", "keep_free")


def test_dtype_table_agrees_with_torch_and_safetensors() -> None:
    from safetensors.torch import _TYPES  # the format's own table

    for row in DTYPES:
        assert getattr(torch, row.name) is row.dtype and dtype_name(row.dtype) == row.name
        for name in (row.name, f"torch.{row.name}", row.short):
            if name is not None:
                assert dtype_from_name(name) is row.dtype
        assert safetensors_code(row.dtype) == row.safetensors
        if row.safetensors is not None:
            assert _TYPES[row.safetensors] is row.dtype and dtype_from_safetensors(row.safetensors) is row.dtype
    assert dtype_from_name("BF16") is torch.bfloat16 and dtype_from_name("nope") is None
    assert dtype_from_safetensors("F4") is None
