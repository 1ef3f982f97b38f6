"""Products with a weight stored narrower than the dtype they compute in (CPU; an accelerator casts).

:class:`~torchsurgery.compact.tensor.OffloadedTensor` calls :func:`narrow_product` for
``F.linear`` and ``torch.addmm`` without gradients. For a few rows (a decoding step) the
product is taken straight from the narrow weight, widened in registers: one pass over half
the bytes (a quarter for fp8), which on a memory-bound step beats the wide model itself.
Three paths, each falling back to the next for a (layout, rows, dtype, shape) it cannot serve:

1. the native kernel (:mod:`torchsurgery.compact.narrow_matvec`): fp32 compute, bf16,
   fp16 or fp8 storage, 1 to 8 rows, both weight layouts; built once per machine, in the
   background. While it builds, few rows take the cast path a cache-sized slice of the
   weight at a time (:func:`through_cache`): the narrow bytes are read from memory once and
   the widened slice is read back from the cache, so no forward waits for a compiler;
2. kernels compiled by ``torch.compile`` with symbolic weight shapes, one per (layout,
   row count, dtypes), so their number does not grow with the number of layer shapes;
   their body never runs eagerly (that would build a rows x out x in temporary);
3. the cast path (more rows, small weights, or neither kernel available): the weight is
   widened into a reused per-thread buffer (fresh allocations page-fault) and multiplied.

transformers' ``Conv1D`` (weight stored ``[in, out]``, multiplied with ``torch.addmm``)
keeps its layout: both kernels have a variant that reads that layout front to back.

A narrow weight on an accelerator (one an offload keeps resident there) is widened by one
cast per product and multiplied as the plain layer multiplies, so it computes exactly as
the same weight streamed in and cast.

Concurrent forwards from several threads are safe: kernels are shared read-only and each
thread widens into its own buffer.
"""

from __future__ import annotations

import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchsurgery.compact.narrow_matvec import NATIVE_DTYPES, NATIVE_MAX_ROWS, narrow_matvec

_SLICE_BYTES = 1 << 21  # a widened slice of weight: stays in the cache until it is multiplied
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




def widen_into(out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``out.copy_(weight)``, exact, with fp8 widened through fp16's vector conversion.

    torch converts fp8 one element at a time (several times slower than bf16); an fp8 value
    is an fp16 bit pattern a shift away (e5m2 is fp16's top byte; e4m3fn's is 2^8 too small),
    and fp16 widens in vector instructions. A slice holding an e4m3fn NaN takes torch's own
    conversion (the shifted pattern would read as 480).

    Example:
        >>> import torch
        >>> w = torch.tensor([0.5, -3.0, 448.0]).to(torch.float8_e4m3fn)
        >>> widen_into(torch.empty(3), w).tolist()
        [0.5, -3.0, 448.0]
    """
    fp8 = weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if not fp8 or out.dtype != torch.float32 or not weight.is_contiguous() or not out.is_contiguous():
        return out.copy_(weight)
    bits = weight.view(torch.uint8)
    if weight.dtype == torch.float8_e4m3fn:
        signed = bits.view(torch.int8)
        if int(bits.max()) == 0xFF or int(signed.max()) == 0x7F:  # e4m3fn's NaNs: the largest bytes either way
            return out.copy_(weight)
        # the byte sign-extended and moved up 7 bits: the sign in bits 15 and 14, exponent and
        # mantissa below; with bit 14 cleared, the value as an fp16 pattern 2^8 too small
        half = signed.to(torch.int16).bitwise_left_shift_(7).bitwise_and_(-16385)
        return torch.mul(half.view(torch.float16), 256.0, out=out)
    return out.copy_(bits.to(torch.int16).bitwise_left_shift_(8).view(torch.float16))


class Scratch:
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
        return widen_into(buffer[:nbytes].view(dtype).view(weight.shape), weight)

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


def is_matmul_layer(module: nn.Module) -> bool:
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


def prepare_kernel(dtype: torch.dtype, device: torch.device) -> None:
    """Start building the native kernel if weights of ``dtype`` on ``device`` will need it.

    Called when weights are offloaded, so that the build (in the background) has a head
    start on the first forward; returns at once.
    """
    start = getattr(narrow_matvec, "start", None)
    if dtype in NATIVE_DTYPES and device.type == "cpu" and start is not None:
        start(dtype)


def through_cache(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool, scratch: Scratch | None
) -> torch.Tensor:
    """``x2d @ weight.T + bias`` (``x2d @ weight + bias`` when ``transposed``), a slice at a time.

    Each slice of the weight (about 2 MiB widened) is widened into ``scratch`` and multiplied
    while it is still in the cache: the narrow weight is read from memory once, and no
    weight-sized buffer is written. The sums are fp32 sums of the same products as the
    native kernel's, in another order.

    Example:
        >>> import torch
        >>> from torchsurgery.compact.narrow import through_cache
        >>> through_cache(torch.ones(1, 3), torch.eye(3, dtype=torch.bfloat16), None, False, None).tolist()
        [[1.0, 1.0, 1.0]]
    """
    dtype, rows = x2d.dtype, x2d.shape[0]
    wide_bias = None if bias is None else bias.to(dtype)
    if transposed:  # [in, out]: y = sum over slices of rows of x[:, rows] @ W[rows]
        inp, out = weight.shape
        step = max(1, _SLICE_BYTES // max(1, out * dtype.itemsize))
        y = wide_bias.expand(rows, out).clone() if wide_bias is not None else x2d.new_zeros(rows, out)
        for i in range(0, inp, step):
            part = weight[i : i + step]
            wide = scratch.widen(part, dtype) if scratch is not None else widen_into(torch.empty(part.shape, dtype=dtype), part)
            y.addmm_(x2d[:, i : i + step], wide)
        return y
    out, inp = weight.shape  # [out, in]: y.T[slice] = W[slice] @ x.T
    step = max(1, _SLICE_BYTES // max(1, inp * dtype.itemsize))
    yt = x2d.new_empty(out, rows)
    xt = x2d.t()
    for o in range(0, out, step):
        part = weight[o : o + step]
        wide = scratch.widen(part, dtype) if scratch is not None else widen_into(torch.empty(part.shape, dtype=dtype), part)
        torch.mm(wide, xt, out=yt[o : o + step])
    return yt.t().contiguous() if wide_bias is None else torch.add(yt.t(), wide_bias)


def _few_rows(
    x: torch.Tensor, rows: int, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
    scratch: Scratch | None, scale: torch.Tensor | None,
) -> torch.Tensor | None:
    """The product from the narrow weight for 1 to 8 rows without gradients, or None: cast.

    ``x`` keeps its leading dimensions, and so does the result. A ``scale`` is applied by the
    native kernel only; the other paths here leave it (and the bias with it) to the caller.
    """
    if (
        x.dtype == torch.float32
        and weight.dtype in NATIVE_DTYPES
        and weight.is_contiguous()
        and (bias is None or bias.is_contiguous())
    ):
        out = narrow_matvec(x.contiguous(), weight, bias, transposed, scale)
        if out is not None:
            return out
        pending = scale is None and getattr(narrow_matvec, "pending", False)
        if pending:  # the kernel is on its way: nothing compiles meanwhile
            sliced = through_cache(x.reshape(rows, x.shape[-1]), weight, bias, transposed, scratch)
            return sliced.reshape(*x.shape[:-1], sliced.shape[-1])
    if scale is not None:  # the caller scales the sums the other paths give
        return None
    if rows <= _FUSED_MAX_ROWS and weight.numel() >= _FUSED_MIN_WEIGHT:
        result = _fused(x.reshape(rows, x.shape[-1]).contiguous(), weight, bias, transposed)
        if result is not None:
            return result.reshape(*x.shape[:-1], result.shape[-1])
    return None


@torch.library.custom_op("torchsurgery::narrow_product", mutates_args=())
def narrow_product_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """:func:`narrow_product` as one operator, for graphs that ``torch.compile`` builds.

    A compiled forward of an offloaded model calls it where the plain model multiplies by a
    narrow weight (see :mod:`torchsurgery.compact.tensor`), so the graph reads the narrow
    values at run time (the native kernel for a few rows) instead of a widened copy of the
    weight made in the graph at every call. It has no backward of its own: it is called
    below autograd, which records the matmul it stands for.
    The result is always new memory, as an operator's output must be: every path of
    :func:`narrow_product` writes a new tensor.

    Example:
        >>> import torch
        >>> from torchsurgery.compact.narrow import narrow_product_op
        >>> narrow_product_op(torch.ones(1, 2), torch.eye(2, dtype=torch.bfloat16), None, False).tolist()
        [[1.0, 1.0]]
    """
    return narrow_product(x, weight, bias, transposed, None)


@narrow_product_op.register_fake
def _narrow_product_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[1] if transposed else weight.shape[0]))


def _scaled_sums(
    x: torch.Tensor, rows: int, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
    scratch: Scratch | None, scale: torch.Tensor,
) -> torch.Tensor:
    """:func:`narrow_product` with a scale: the native kernel scales each sum; elsewhere the sums, then scale and bias."""
    if weight.device.type == "cpu" and weight.dtype != x.dtype and 0 < rows <= NATIVE_MAX_ROWS:
        out = _few_rows(x, rows, weight, bias, transposed, scratch, scale)
        if out is not None:
            return out
    out = narrow_product(x, weight, None, transposed, scratch).mul_(scale.to(x.dtype))
    return out if bias is None else out.add_(bias.to(x.dtype))


def narrow_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool, scratch: Scratch | None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` (``x @ weight + bias`` when ``transposed``) in ``x``'s dtype, without gradients.

    ``weight`` is 2-d in any dtype (narrower than ``x``'s, or the same); ``x`` keeps its
    leading dimensions, and so does the result. A weight widened for the cast path goes
    into ``scratch`` (or a fresh tensor without one). ``scale`` (fp32, one value per output
    or 0-d) multiplies the sums before the bias is added: ``(x @ weight.T) * scale + bias``,
    the native kernel doing it as it writes each sum.

    Example:
        >>> import torch
        >>> from torchsurgery.compact.narrow import Scratch, narrow_product
        >>> w = torch.eye(3, dtype=torch.bfloat16)
        >>> narrow_product(torch.ones(2, 3), w, None, False, Scratch()).tolist()
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    """
    dtype = x.dtype
    rows = x.numel() // max(1, x.shape[-1])
    host = weight.device.type == "cpu"
    if scale is not None:
        return _scaled_sums(x, rows, weight, bias, transposed, scratch, scale)
    if weight.dtype != dtype:
        if host and 0 < rows <= NATIVE_MAX_ROWS:
            out = _few_rows(x, rows, weight, bias, transposed, scratch, None)
            if out is not None:
                return out
        # on an accelerator the widened copy lives for the product only: its allocator reuses
        # the memory, where a buffer kept per thread would hold it for good
        weight = scratch.widen(weight, dtype) if scratch is not None and host else weight.to(dtype)
    wide_bias = bias if bias is None or bias.dtype == dtype else bias.to(dtype)
    x2d = x.reshape(rows, x.shape[-1])
    matrix = weight if transposed else weight.t()
    out = x2d @ matrix if wide_bias is None else torch.addmm(wide_bias, x2d, matrix)
    return out.reshape(*x.shape[:-1], matrix.shape[1])
