"""Checking the arguments every pillar shares: dtypes, devices and byte counts.

One table names each dtype the library reads or writes (its PyTorch name, the short
name the command line accepts, its safetensors code), and one function per kind of
argument checks a value and names the caller, the argument and what it accepts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from torchsurgery.errors import ArgumentTypeError, ArgumentValueError, Setting


@dataclass(frozen=True)
class DtypeName:
    """The names of one dtype.

    Attributes:
        dtype: the ``torch.dtype``.
        name: PyTorch's name without ``torch.`` (``"bfloat16"``).
        short: the short name (``"bf16"``), or ``None``.
        safetensors: the safetensors header code (``"BF16"``), or ``None`` where there is none.
    """

    dtype: torch.dtype
    name: str
    short: str | None
    safetensors: str | None


def _row(dtype: torch.dtype, short: str | None, code: str | None) -> DtypeName:
    return DtypeName(dtype, str(dtype).removeprefix("torch."), short, code)


DTYPES: tuple[DtypeName, ...] = (
    _row(torch.float64, "fp64", "F64"),
    _row(torch.float32, "fp32", "F32"),
    _row(torch.float16, "fp16", "F16"),
    _row(torch.bfloat16, "bf16", "BF16"),
    _row(torch.float8_e4m3fn, "fp8", "F8_E4M3"),
    _row(torch.float8_e5m2, "fp8_e5m2", "F8_E5M2"),
    _row(torch.int64, None, "I64"),
    _row(torch.int32, None, "I32"),
    _row(torch.int16, None, "I16"),
    _row(torch.int8, None, "I8"),
    _row(torch.uint8, None, "U8"),
    _row(torch.uint16, None, "U16"),
    _row(torch.uint32, None, "U32"),
    _row(torch.uint64, None, "U64"),
    _row(torch.bool, None, "BOOL"),
    _row(torch.complex64, None, "C64"),
    _row(torch.complex128, None, None),
)
"""Every dtype the library reads or writes, with its names."""

_BY_NAME: dict[str, DtypeName] = {
    key: row for row in DTYPES for key in (row.name, f"torch.{row.name}", row.short) if key is not None
}
_BY_CODE: dict[str, DtypeName] = {row.safetensors: row for row in DTYPES if row.safetensors is not None}
_BY_DTYPE: dict[torch.dtype, DtypeName] = {row.dtype: row for row in DTYPES}


def dtype_from_name(name: str) -> torch.dtype | None:
    """The dtype called ``name`` (``"bf16"``, ``"bfloat16"`` or ``"torch.bfloat16"``), or ``None``.

    Example:
        >>> dtype_from_name("bf16"), dtype_from_name("torch.float32"), dtype_from_name("nope")
        (torch.bfloat16, torch.float32, None)
    """
    row = _BY_NAME.get(name.lower() if name.lower() in _BY_NAME else name)
    return row.dtype if row is not None else None


def dtype_name(dtype: torch.dtype) -> str:
    """PyTorch's name for ``dtype`` without ``torch.``.

    Example:
        >>> dtype_name(torch.bfloat16)
        'bfloat16'
    """
    return str(dtype).removeprefix("torch.")


def dtype_from_safetensors(code: str) -> torch.dtype | None:
    """The dtype of a safetensors header code (``"BF16"``), or ``None`` for an unknown code.

    Example:
        >>> dtype_from_safetensors("F8_E4M3")
        torch.float8_e4m3fn
    """
    row = _BY_CODE.get(code)
    return row.dtype if row is not None else None


def safetensors_code(dtype: torch.dtype) -> str | None:
    """The safetensors header code of ``dtype``, or ``None`` where the format has none.

    Example:
        >>> safetensors_code(torch.float16)
        'F16'
    """
    row = _BY_DTYPE.get(dtype)
    return row.safetensors if row is not None else None


def check_dtype(value: Any, what: str, arg: str = "dtype", *, complex_ok: bool = False) -> torch.dtype | None:
    """``value`` if it is a floating point (or, with ``complex_ok``, complex) dtype; ``None`` stays ``None``.

    Accepted are the dtypes ``nn.Module.to`` takes: floating point ones PyTorch can cast
    a tensor to (not the packed ``torch.float4_e2m1fn_x2``), and complex ones with ``complex_ok``.

    Args:
        value: what the caller was given.
        what: the caller's name, for the message (``"torchsurgery.offload"``).
        arg: the argument's name.
        complex_ok: accept complex dtypes too (as ``module.to`` does).

    Raises:
        ArgumentTypeError: ``value`` is not a ``torch.dtype`` (a ``TypeError``).
        ArgumentValueError: it is a dtype of the wrong kind, an integer dtype say (a ``ValueError``).

    Example:
        >>> check_dtype(torch.bfloat16, "example")
        torch.bfloat16
        >>> check_dtype(torch.int8, "example", "storage_dtype")
        Traceback (most recent call last):
        ...
        torchsurgery.errors.ArgumentValueError: example: storage_dtype must be a floating point dtype, got torch.int8
    """
    if value is None:
        return None
    kinds = "a floating point or complex dtype" if complex_ok else "a floating point dtype"
    if not isinstance(value, torch.dtype):
        raise ArgumentTypeError(what, arg, value, f"must be {kinds} (a torch.dtype such as torch.bfloat16), got {value!r}")
    if not (value.is_floating_point or (complex_ok and value.is_complex)):
        raise ArgumentValueError(what, arg, value, f"must be {kinds}, got {value}")
    if not _castable(value):
        raise ArgumentValueError(what, arg, value, f"must be {kinds} PyTorch can cast tensors to, got {value}")
    return value


@functools.cache
def _castable(dtype: torch.dtype) -> bool:
    # packed dtypes (torch.float4_e2m1fn_x2) are floating point, but nothing casts to them
    try:
        torch.zeros(1).to(dtype)
    except (RuntimeError, NotImplementedError):
        return False
    return True


STORAGE_DTYPES: tuple[torch.dtype, ...] = tuple(row.dtype for row in DTYPES if row.dtype.is_floating_point)
"""The dtypes a weight can be stored in (``storage_dtype``) or kept in (``master_dtype``).

The floating dtypes of :data:`DTYPES`: a plain weight converts to each and back, keeping its
values up to that dtype's rounding, and checkpoints and the command line name each. Not
``float8_e8m0fnu`` (powers of two only: no sign, no mantissa), nor the ``fnuz`` fp8 variants
(they convert, but no checkpoint this library reads and no command-line name holds them).
"""


def holds_exactly(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Whether every value of the floating dtype ``narrow`` is a value of ``wide``.

    It is when ``wide`` has at least the precision, the largest value and the smallest
    (subnormal) step of ``narrow``.

    Example:
        >>> holds_exactly(torch.float32, torch.bfloat16), holds_exactly(torch.float16, torch.bfloat16)
        (True, False)
    """
    a, b = torch.finfo(wide), torch.finfo(narrow)
    return a.eps <= b.eps and a.max >= b.max and a.smallest_normal * a.eps <= b.smallest_normal * b.eps


def check_storage_dtype(value: Any, what: str, arg: str = "storage_dtype") -> torch.dtype | None:
    """``value`` if weights can be stored in it (one of :data:`STORAGE_DTYPES`); ``None`` stays ``None``.

    Args:
        value: what the caller was given.
        what: the caller's name, for the message (``"torchsurgery.offload"``).
        arg: the argument's name (``"storage_dtype"``, ``"master_dtype"``).

    Raises:
        ArgumentTypeError: anything else, a dtype or not (a ``TypeError``, as ``nn.Module.to``
            raises for a dtype it cannot take); the message lists the accepted dtypes.

    Example:
        >>> check_storage_dtype(torch.bfloat16, "example")
        torch.bfloat16
        >>> check_storage_dtype(torch.float8_e8m0fnu, "example")
        Traceback (most recent call last):
        ...
        torchsurgery.errors.ArgumentTypeError: example: storage_dtype must be a dtype weights can be stored in and read back from (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2), got torch.float8_e8m0fnu
    """
    if value is None:
        return None
    if not isinstance(value, torch.dtype) or value not in STORAGE_DTYPES:
        choices = ", ".join(str(d) for d in STORAGE_DTYPES)
        raise ArgumentTypeError(
            what, arg, value, f"must be a dtype weights can be stored in and read back from ({choices}), got {value!r}"
        )
    return value


def check_device(value: Any, what: str) -> torch.device | None:
    """``value`` as a ``torch.device`` that exists on this machine; ``None`` stays ``None``.

    ``cpu`` and ``meta`` always exist; an accelerator must be the one PyTorch reports and
    its index must be in range.

    Raises:
        ArgumentValueError: not a device, or no such device here (a ``ValueError``); its
            fix suggests ``device='cpu'``.

    Example:
        >>> check_device("cpu", "example")
        device(type='cpu')
        >>> check_device("tpu", "example")
        Traceback (most recent call last):
        ...
        torchsurgery.errors.ArgumentValueError: example: device 'tpu' is not a device (...)
    """
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        reason = str(exc).splitlines()[0][:160]  # torch's own words, shortened
        raise ArgumentValueError(what, "device", value, f"{value!r} is not a device ({reason})") from exc
    if device.type in ("cpu", "meta"):
        return device
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != device.type:
        have = f"'cpu' and {accelerator.type!r}" if accelerator is not None else "only 'cpu'"
        raise ArgumentValueError(
            what, "device", value, f"{str(value)!r} is not available: this PyTorch reports {have}",
            "use {} or an available accelerator", Setting("device", "cpu"),
        )
    count = torch.accelerator.device_count()
    if device.index is not None and not 0 <= device.index < count:
        raise ArgumentValueError(
            what, "device", value, f"{str(value)!r} does not exist ({count} {device.type} devices)",
            "use {} or an available accelerator", Setting("device", "cpu"),
        )
    return device


def check_bytes(value: Any, what: str, arg: str) -> int | None:
    """``value`` if it is a byte count (an ``int`` >= 0); ``None`` stays ``None``.

    Raises:
        ArgumentTypeError: not an ``int``; a ``bool`` is not a byte count (a ``TypeError``).
        ArgumentValueError: negative (a ``ValueError``).

    Example:
        >>> check_bytes(1 << 20, "example", "budget")
        1048576
        >>> check_bytes(-1, "example", "budget")
        Traceback (most recent call last):
        ...
        torchsurgery.errors.ArgumentValueError: example: budget must be a number of bytes (int >= 0) or None, got -1
    """
    if value is None:
        return None
    problem = f"must be a number of bytes (int >= 0) or None, got {value!r}"
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentTypeError(what, arg, value, problem)
    if value < 0:
        raise ArgumentValueError(what, arg, value, problem)
    return value
