"""The shared argument checks accept what PyTorch accepts and refuse the rest with a typed error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from torchsurgery._validate import (
    DTYPES,
    check_bytes,
    check_device,
    check_dtype,
    dtype_from_name,
    dtype_from_safetensors,
    dtype_name,
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
