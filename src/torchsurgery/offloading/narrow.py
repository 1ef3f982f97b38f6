"""Linear layers whose stored weight is narrower than the dtype they compute in (CPU).

For a few rows (a decoding step) the product is taken straight from the narrow weight,
widened in registers: one pass over half the bytes (a quarter for fp8), which on a
memory-bound step beats the wide model itself. Three paths, each falling back to the
next for a (layout, rows, dtype, shape) it cannot serve:

1. the native kernel (:mod:`torchsurgery.offloading.narrow_matvec`): fp32 compute, bf16,
   fp16 or fp8 storage, 1 to 8 rows, both weight layouts; built once per machine;
2. kernels compiled by ``torch.compile`` with symbolic weight shapes, one per (layout,
   row count, dtypes), so their number does not grow with the number of layer shapes;
   their body never runs eagerly (that would build a rows x out x in temporary);
3. the cast path (more rows, small weights, training, or neither kernel available):
   the weight is widened into a reused per-thread buffer (fresh allocations page-fault)
   and multiplied.

transformers' ``Conv1D`` (weight stored ``[in, out]``) keeps its layout: both kernels
have a variant that reads that layout front to back. With a master copy, forwards
without gradients read a narrow copy refreshed whenever the master parameter changes.

Concurrent forwards from several threads are safe: kernels are shared read-only, each
thread widens into its own buffer, and narrow copies are refreshed under a lock.
"""

from __future__ import annotations

import threading
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchsurgery.offloading.narrow_matvec import NATIVE_DTYPES, NATIVE_MAX_ROWS, narrow_matvec
from torchsurgery.offloading.stats import OffloadStats
from torchsurgery.patching import Patch

_FUSED_MIN_WEIGHT = 1 << 18  # below this a fused kernel does not pay for itself
_FUSED_MAX_ROWS = 4


class _RanEagerly(RuntimeError):
    """A fused kernel's body was about to run outside the compiler."""


def _rows_from_narrow(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # weight [out, in]: every row's dot products in one pass over the narrow weight
    if not torch.compiler.is_compiling():
        raise _RanEagerly("the fused kernel runs only compiled")
    wide = weight.to(x.dtype)
    out = torch.stack([(x[r] * wide).sum(-1) for r in range(x.shape[0])])
    return out if bias is None else out + bias.to(x.dtype)


def _rows_from_narrow_t(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # weight [in, out] (Conv1D layout): reduce over the weight's rows so reads stay contiguous
    if not torch.compiler.is_compiling():
        raise _RanEagerly("the fused kernel runs only compiled")
    wide = weight.to(x.dtype)
    out = torch.stack([(x[r].unsqueeze(-1) * wide).sum(0) for r in range(x.shape[0])])
    return out if bias is None else out + bias.to(x.dtype)


_KernelKey = tuple[bool, int, torch.dtype, torch.dtype, bool]


class _FusedKernels:
    """Compiled narrow-weight kernels, shared by every layer and thread of the process.

    One kernel per (layout, rows, weight dtype, compute dtype, bias or not), each on its own
    copy of the Python code so the compiler's per-function recompile limit never applies
    across keys; weight shapes are symbolic inside a kernel. A (key, weight shape) pair
    whose compilation or run failed is remembered and takes the cast path from then on.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kernels: dict[_KernelKey, Callable[..., torch.Tensor]] = {}
        self.failed: set[tuple[_KernelKey, tuple[int, ...]]] = set()

    def _kernel(self, key: _KernelKey) -> Callable[..., torch.Tensor]:
        with self.lock:
            kernel = self.kernels.get(key)
            if kernel is None:
                base = _rows_from_narrow_t if key[0] else _rows_from_narrow
                code = base.__code__.replace()  # a distinct code object: its own compile cache
                fn = types.FunctionType(code, base.__globals__, base.__name__)
                kernel = self.kernels[key] = torch.compile(fn, dynamic=True, fullgraph=True)
            return kernel

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool
    ) -> torch.Tensor | None:
        """``x @ weight.T + bias`` (``x @ weight`` when ``transposed``), or None: cast instead."""
        key: _KernelKey = (transposed, x.shape[0], weight.dtype, x.dtype, bias is not None)
        shape = tuple(weight.shape)
        if (key, shape) in self.failed:
            return None
        try:
            # plain tensors, not Parameters: the compiler keeps parameter shapes static
            plain_bias = None if bias is None else bias.detach()
            result: torch.Tensor = self._kernel(key)(x.detach(), weight.detach(), plain_bias)
            return result
        except Exception as exc:  # no compiler, or it failed for this shape: cast this shape
            with self.lock:
                self.failed.add((key, shape))
            warnings.warn(
                f"torchsurgery.offload: no fused CPU kernel for a {weight.dtype} weight of shape {list(shape)} "
                f"with {x.shape[0]} row(s) ({type(exc).__name__}: {exc}); that shape casts instead",
                stacklevel=3,
            )
            return None


_fused = _FusedKernels()


class _Scratch:
    """Reused full-width copies of narrow weights: one flat buffer per thread.

    A buffer grows to the largest weight its thread has widened and is reused for every
    shape after, so the memory held is at most (threads that ran the cast path) x (the
    largest widened weight); it goes with its thread, or with ``clear()``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: weakref.WeakKeyDictionary[threading.Thread, torch.Tensor] = weakref.WeakKeyDictionary()

    def widen(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight`` converted to ``dtype`` in this thread's buffer (valid until its next call)."""
        thread = threading.current_thread()
        nbytes = weight.numel() * dtype.itemsize
        with self._lock:
            buffer = self._buffers.get(thread)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            with self._lock:
                self._buffers[thread] = buffer
        return buffer[:nbytes].view(dtype).view(weight.shape).copy_(weight)

    def nbytes(self) -> int:
        """Bytes the buffers hold now."""
        with self._lock:
            return sum(b.numel() for b in self._buffers.values())

    def clear(self) -> None:
        """Free every thread's buffer."""
        with self._lock:
            self._buffers.clear()

    def __getstate__(self) -> dict[str, Any]:
        return {}  # buffers are a cache: a copy starts without

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


class _Shadows:
    """Narrow copies of master parameters, refreshed when the master changes (its version)."""

    def __init__(self) -> None:
        self.entries: dict[int, list[Any]] = {}
        self._lock = threading.Lock()

    def add(self, param: torch.Tensor, dtype: torch.dtype) -> None:
        if id(param) not in self.entries:
            self.entries[id(param)] = [param.detach().to(dtype), param._version]

    def narrow(self, param: torch.Tensor) -> torch.Tensor:
        entry = self.entries.get(id(param))
        if entry is None:
            return param
        if entry[1] != param._version:  # an optimizer step (or any in-place write) since
            with self._lock:  # one thread refreshes; the others wait for the fresh copy
                if entry[1] != param._version:
                    entry[0].copy_(param.detach())
                    entry[1] = param._version
        copy: torch.Tensor = entry[0]
        return copy

    def __getstate__(self) -> dict[str, Any]:
        return {"entries": self.entries}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.entries = state["entries"]
        self._lock = threading.Lock()


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


def _few_rows(
    x: torch.Tensor, rows: int, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool
) -> torch.Tensor | None:
    """The product from the narrow weight for 1 to 8 rows without gradients, or None: cast.

    ``x`` keeps its leading dimensions, and so does the result.
    """
    if (
        x.dtype == torch.float32
        and weight.dtype in NATIVE_DTYPES
        and weight.is_contiguous()
        and (bias is None or bias.is_contiguous())
    ):
        out = narrow_matvec(x.contiguous(), weight, bias, transposed)
        if out is not None:
            return out
    if rows <= _FUSED_MAX_ROWS and weight.numel() >= _FUSED_MIN_WEIGHT:
        result = _fused(x.reshape(rows, x.shape[-1]).contiguous(), weight, bias, transposed)
        if result is not None:
            return result.reshape(*x.shape[:-1], result.shape[-1])
    return None


@dataclass
class _NarrowState:
    """What a narrow layer's forward needs, kept in the module's ``__dict__``."""

    compute_dtype: torch.dtype
    stats: OffloadStats
    scratch: _Scratch
    shadows: _Shadows
    transposed: bool  # weight stored [in, out] (Conv1D)


class _NarrowMatmul(Patch, nn.Module):
    """A Linear (or Conv1D) whose stored weight is narrower than the dtype it computes in."""

    def __patch_init__(
        self, compute_dtype: torch.dtype, stats: OffloadStats, scratch: _Scratch, shadows: _Shadows
    ) -> None:
        self.__dict__["_offload_narrow"] = _NarrowState(
            compute_dtype, stats, scratch, shadows, transposed=not isinstance(self, nn.Linear)
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        state: _NarrowState = self.__dict__["_offload_narrow"]
        dtype, stats, transposed = state.compute_dtype, state.stats, state.transposed
        weight: torch.Tensor = self._parameters["weight"]  # type: ignore[assignment]
        bias: torch.Tensor | None = self._parameters.get("bias")
        x = input if input.dtype == dtype else input.to(dtype)
        rows = x.numel() // max(1, x.shape[-1])
        stats.bytes_moved += weight.numel() * weight.element_size()
        stats.transfers += 1
        stats.peak_device_bytes = max(stats.peak_device_bytes, stats.resident_bytes + weight.numel() * dtype.itemsize)
        needs_grad = torch.is_grad_enabled() and (
            weight.requires_grad or x.requires_grad or (bias is not None and bias.requires_grad)
        )
        if needs_grad or torch.compiler.is_compiling():
            # autograd keeps the widened weight until backward: a fresh one; inside a
            # compiled model the compiler fuses the cast into its own kernels
            wide = weight.to(dtype)
            wide_bias = bias.to(dtype) if bias is not None else None
        else:  # with a master copy, forwards without gradients read the narrow copy
            weight = state.shadows.narrow(weight)
            bias = state.shadows.narrow(bias) if bias is not None else None
            if 0 < rows <= NATIVE_MAX_ROWS:
                out = _few_rows(x, rows, weight, bias, transposed)
                if out is not None:
                    return out
            wide = state.scratch.widen(weight, dtype)
            wide_bias = bias.to(dtype) if bias is not None else None
        x2d = x.reshape(rows, x.shape[-1])
        matrix = wide if transposed else wide.t()
        out = x2d @ matrix if wide_bias is None else torch.addmm(wide_bias, x2d, matrix)
        return out.reshape(*x.shape[:-1], matrix.shape[1])
