"""Linear layers whose stored weight is narrower than the dtype they compute in (CPU).

For a few rows (a decoding step) a fused kernel, compiled once per shape with
``torch.compile``, reduces straight from the narrow weight in the wide dtype: one pass
over half the bytes, which on a memory-bound step beats the wide model itself. For more
rows the weight is widened once into a reused buffer (fresh allocations page-fault) and
multiplied. transformers' ``Conv1D`` (weight stored ``[in, out]``) gets its own kernel so
that its reads stay contiguous. With a master copy, forwards without gradients read a
narrow copy refreshed whenever the master parameter changes.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from torchsurgery.offload.stats import OffloadStats
from torchsurgery.patching import Patch

_fused_kernels: dict[bool, Any] = {}
_fused_broken = False
_FUSED_MIN_WEIGHT = 1 << 18  # below this a fused kernel does not pay for itself
_FUSED_MAX_ROWS = 4


def _reduce_from_narrow(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # weight [out, in]: one pass over the narrow weight, widened in registers
    return (x.unsqueeze(-2) * weight.to(x.dtype)).sum(-1)


def _reduce_from_narrow_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # weight [in, out] (Conv1D layout): reduce over rows so reads stay contiguous
    return (x.unsqueeze(-1) * weight.to(x.dtype)).sum(-2)


def _fused_linear(x: torch.Tensor, weight: torch.Tensor, transposed: bool = False) -> torch.Tensor | None:
    global _fused_broken
    if _fused_broken:
        return None
    try:
        kernel = _fused_kernels.get(transposed)
        if kernel is None:
            kernel = _fused_kernels[transposed] = torch.compile(
                _reduce_from_narrow_t if transposed else _reduce_from_narrow, dynamic=False
            )
        result: torch.Tensor = kernel(x, weight)
        return result
    except Exception as exc:  # no compiler on this machine: fall back to casting
        _fused_broken = True
        warnings.warn(f"torchsurgery.offload: fused CPU kernel unavailable ({exc}); casting instead", stacklevel=2)
        return None


class _Scratch:
    """Reused full-width copies of narrow weights, one per shape (fresh allocations page-fault)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def widen(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(weight.shape), dtype)
        buffer = self.buffers.get(key)
        if buffer is None:
            buffer = self.buffers[key] = torch.empty(weight.shape, dtype=dtype)
        return buffer.copy_(weight)


class _Shadows:
    """Narrow copies of master parameters, refreshed when the master changes (its version)."""

    def __init__(self) -> None:
        self.entries: dict[int, list[Any]] = {}

    def add(self, param: torch.Tensor, dtype: torch.dtype) -> None:
        if id(param) not in self.entries:
            self.entries[id(param)] = [param.detach().to(dtype), param._version]

    def narrow(self, param: torch.Tensor) -> torch.Tensor:
        entry = self.entries.get(id(param))
        if entry is None:
            return param
        if entry[1] != param._version:  # an optimizer step (or any in-place write) since
            entry[0].copy_(param.detach())
            entry[1] = param._version
        copy: torch.Tensor = entry[0]
        return copy


def _is_matmul_layer(module: nn.Module) -> bool:
    """nn.Linear, or a transformers-style Conv1D (weight stored [in, out], attribute ``nf``)."""
    if isinstance(module, nn.Linear):
        return True
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and getattr(module, "nf", None) == weight.shape[1]
    )


class _NarrowMatmul(Patch, nn.Module):
    """A Linear (or Conv1D) whose stored weight is narrower than the dtype it computes in."""

    def __patch_init__(
        self, compute_dtype: torch.dtype, stats: OffloadStats, scratch: _Scratch, shadows: _Shadows
    ) -> None:
        self.__dict__["_offload_narrow"] = (compute_dtype, stats, scratch, shadows, not isinstance(self, nn.Linear))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dtype, stats, scratch, shadows, transposed = self.__dict__["_offload_narrow"]
        weight: torch.Tensor = self._parameters["weight"]  # type: ignore[assignment]
        bias: torch.Tensor | None = self._parameters.get("bias")
        x = input.to(dtype)
        stats.bytes_moved += weight.numel() * weight.element_size()
        stats.transfers += 1
        stats.peak_device_bytes = max(stats.peak_device_bytes, stats.resident_bytes + weight.numel() * dtype.itemsize)
        rows = x.numel() // max(1, x.shape[-1])
        out_features = weight.shape[1] if transposed else weight.shape[0]
        needs_grad = torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)
        x2d = x.reshape(rows, x.shape[-1])
        if not needs_grad:  # with a master copy, forwards without gradients read the narrow copy
            weight = shadows.narrow(weight)
            bias = shadows.narrow(bias) if bias is not None else None
        out: torch.Tensor | None = None
        if not needs_grad and rows <= _FUSED_MAX_ROWS and weight.numel() >= _FUSED_MIN_WEIGHT:
            out = _fused_linear(x2d, weight, transposed)
        if out is None:
            wide = weight.to(dtype) if needs_grad else scratch.widen(weight, dtype)
            out = x2d @ wide if transposed else x2d @ wide.t()
        if bias is not None:
            out = out + bias.to(dtype)
        return out.reshape(*x.shape[:-1], out_features)


