"""Scaled compact formats: a narrow weight plus a scale per output channel or per tensor.

Casting a weight of typical size (std 0.02) straight to fp8 puts most of its values in
e4m3's subnormal range; the fp8 checkpoints people download (ComfyUI's "fp8 scaled") and
torchao's float8 and int8 weight-only formats keep a scale beside the narrow values
instead. :class:`Scaled` names such a format; passed as ``storage_dtype`` to
:func:`~torchsurgery.offload`, every weight of two or more dimensions is kept as
``q`` (the narrow values) and ``scale`` (fp32, ``[out, 1, ...]`` per output channel, a scalar
per tensor), and reads as the compute dtype with the values ``(q.float() * scale).to(dtype)``.
One-dimensional parameters (biases) keep the compute dtype, norms and embeddings their own
(``skip``), as with a plain ``storage_dtype``.

The scale is chosen when the weight is stored (the largest magnitude of each channel maps
to the format's largest value) and stays: a later write (an optimizer step,
``load_state_dict``) is rounded to the weight's grid, values beyond its range saturate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from torchsurgery.errors import ArgumentValueError

__all__ = ["Scaled", "quantize_with", "dequantize", "dequantize_temporary_bytes", "scaled_product", "scale_laid_out_as"]

_LARGEST: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: float(torch.finfo(torch.float8_e4m3fn).max),  # 448
    torch.float8_e5m2: float(torch.finfo(torch.float8_e5m2).max),  # 57344
    torch.int8: 127.0,  # symmetric: -128 is never used
}
_PER = ("channel", "tensor")
_WHAT = "torchsurgery.compact.Scaled"

ProductFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]
"""``(x, weight, scale, bias) -> (x @ weight.T) * scale + bias`` in ``x``'s dtype, for a weight in
any dtype; ``scale`` (fp32: one value per output, or 0-d) and ``bias`` may be None."""


@dataclass(frozen=True)
class Scaled:
    """A storage format: narrow values (fp8 or int8) and an fp32 scale per output channel or per tensor.

    Pass it as ``storage_dtype`` to :func:`~torchsurgery.offload`.

    Attributes:
        dtype: the narrow values' dtype: ``torch.float8_e4m3fn``, ``torch.float8_e5m2``, or
            ``torch.int8`` (per channel only: int8 weight-only, symmetric).
        per: ``"channel"`` (one scale per slice along the weight's first dimension:
            ``nn.Linear``'s output channels) or ``"tensor"`` (one scale).

    Raises:
        ValueError: another dtype, another ``per``, or int8 per tensor; the message names the fix.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> from torchsurgery.compact import Scaled
        >>> layer = nn.Linear(4, 2)
        >>> handle = torchsurgery.offload(layer, storage_dtype=Scaled(torch.int8), dtype=torch.float32, groups=[""])
        >>> layer.weight.dtype, layer.weight.stored.dtype, layer.bias.dtype
        (torch.float32, torch.int8, torch.float32)
        >>> _ = handle.remove()
    """

    dtype: torch.dtype
    per: Literal["channel", "tensor"] = "channel"

    def __post_init__(self) -> None:
        if self.dtype not in _LARGEST:
            choices = ", ".join(str(d) for d in _LARGEST)
            raise ArgumentValueError(
                _WHAT, "dtype", self.dtype, f"must be a narrow dtype with a scale ({choices}), got {self.dtype!r}",
                "for a plain (unscaled) dtype pass it as storage_dtype itself",
            )
        if self.per not in _PER:
            raise ArgumentValueError(
                _WHAT, "per", self.per, f"must be 'channel' or 'tensor', got {self.per!r}",
                "per='channel' scales each output channel (a weight's first dimension)",
            )
        if self.dtype == torch.int8 and self.per != "channel":
            raise ArgumentValueError(
                _WHAT, "per", self.per, "int8 is stored with a scale per output channel only",
                "use Scaled(torch.int8, per='channel'), or Scaled(torch.float8_e4m3fn, per='tensor')",
            )

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``values`` as ``(q, scale)``: ``q`` in :attr:`dtype`, ``scale`` fp32 broadcastable to it.

        Example:
            >>> import torch
            >>> q, scale = Scaled(torch.int8).quantize(torch.tensor([[0.5, -1.0], [2.0, 0.0]]))
            >>> q.tolist(), scale.flatten().tolist()
            ([[64, -127], [127, 0]], [0.007874015718698502, 0.015748031437397003])
        """
        magnitude = values.detach().abs().float()
        per_tensor = self.per == "tensor" or values.dim() < 2
        if values.numel() == 0:  # nothing to scale (a layer of zero inputs or outputs): a scale of one
            largest = magnitude.new_zeros(() if per_tensor else (values.shape[0], *[1] * (values.dim() - 1)))
        elif per_tensor:
            largest = magnitude.amax()
        else:
            largest = magnitude.amax(dim=tuple(range(1, values.dim())), keepdim=True)
        # a tensor over a tensor: a GPU divides by a Python number through its reciprocal (one
        # rounding off the CPU's quotient), so a weight quantised on the device would differ
        scale = largest / torch.full_like(largest, _LARGEST[self.dtype])
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero channel
        return quantize_with(values, scale, self.dtype), scale

    def scale_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        """Bytes of the fp32 scale :meth:`quantize` keeps for a weight of ``shape``.

        Example:
            >>> import torch
            >>> Scaled(torch.int8).scale_nbytes((64, 32)), Scaled(torch.float8_e4m3fn, per="tensor").scale_nbytes((64, 32))
            (256, 4)
        """
        per_channel = self.per == "channel" and len(shape) >= 2
        return (shape[0] if per_channel else 1) * torch.float32.itemsize


def quantize_with(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values / scale`` rounded to ``dtype`` (fp8 to nearest, int8 to the nearest integer), saturating.

    Example:
        >>> import torch
        >>> quantize_with(torch.tensor([1.0, -300.0]), torch.tensor(2.0), torch.int8).tolist()
        [0, -127]
    """
    largest = _LARGEST[dtype]
    ratio = (values.detach().float() / scale).clamp_(-largest, largest)
    if dtype == torch.int8:
        ratio.round_()  # half to even, as torch rounds
    return ratio.to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values ``q`` and ``scale`` stand for, in ``dtype``: ``(q.float() * scale).to(dtype)``, bit for bit.

    For fp32, bf16 and fp16 ``q`` is widened into the result and scaled there in place, so no
    tensor besides the result is made: every fp8 and int8 value is exact in all three, and an
    in-place product with the fp32 scale is computed in fp32 and rounded once to ``dtype``, as
    the formula rounds. On an accelerator, where a streamed weight is widened into its ring
    slot, that is two kernels reading and writing 7 bytes a value for bf16 (the formula's three
    and an fp32 copy: 19). Other dtypes take the formula itself. The same values on every
    device, so a weight widened into a ring slot on an accelerator equals the one read on the host.

    Example:
        >>> import torch
        >>> dequantize(torch.tensor([64, -127], dtype=torch.int8), torch.tensor(0.5), torch.float32).tolist()
        [32.0, -63.5]
    """
    if q.dim() == 0:  # one element (w[0, 0]): as a one-element tensor, whose product promotes
        return dequantize(q.reshape(1), scale.reshape(1), dtype).reshape(())
    if dtype in _WIDENED_IN_PLACE:
        # by type promotion a 0-d fp32 tensor does not lift a bf16 one to fp32: with one
        # dimension it does, and the product is computed in fp32 on every backend (the CPU's
        # and the test device's kernels read a 0-d operand in fp32 anyway, a GPU's need not)
        return q.to(dtype, copy=True).mul_(scale if scale.dim() else scale.reshape(1))
    return q.to(torch.float32, copy=True).mul_(scale).to(dtype)


_WIDENED_IN_PLACE = (torch.float32, torch.bfloat16, torch.float16)


def dequantize_temporary_bytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes :func:`dequantize` holds besides its result while it widens ``numel`` values to ``dtype``:
    none where it widens into the result itself, an fp32 copy elsewhere.

    Example:
        >>> import torch
        >>> dequantize_temporary_bytes(16, torch.bfloat16), dequantize_temporary_bytes(16, torch.float64)
        (0, 64)
    """
    return 0 if dtype in _WIDENED_IN_PLACE else numel * torch.float32.itemsize


def scaled_product(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, product: ProductFn
) -> torch.Tensor:
    """``x @ (q * scale).T + bias`` without gradients, the scale applied to the sums where it can be.

    ``scale`` is broadcast to ``q``'s shape ([out, in]). Where it is constant along each row
    (per output channel, or per tensor) and ``x`` is fp32 or wider, the sums are taken from
    ``q`` itself by ``product`` and scaled there (the native kernel reads fp8 and int8 rows in
    place and scales each sum): ``(x @ q.T) * scale + bias``. Otherwise the weight is
    dequantised first: a transposed view of a per-channel weight, and a narrower ``x``, whose
    dtype would sum the unscaled values (e4m3's reach 448) where the plain layer sums scaled
    ones: an fp16 row of 1024 such products overflows to ``inf`` where the plain layer gives 5.

    Example:
        >>> import torch
        >>> q, scale = torch.tensor([[2, 4]], dtype=torch.int8), torch.tensor([[0.5]]).expand(1, 2)
        >>> def plain(x, w, s, b):
        ...     out = x @ w.to(x.dtype).T
        ...     out = out if s is None else out * s
        ...     return out if b is None else out + b
        >>> scaled_product(torch.ones(1, 2), q, scale, torch.tensor([1.0]), plain).tolist()
        [[4.0]]
    """
    if scale.dim() != 2 or scale.stride(1) != 0 or x.dtype.itemsize < torch.float32.itemsize:
        return product(x, dequantize(q, scale, x.dtype), None, bias)
    return product(x, q, scale[:, 0], bias)  # one scale per output: applied to the sums


def scale_laid_out_as(scale: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``scale`` (broadcast to ``values``' shape) as one number per value, laid out as ``values`` are.

    The same shape, strides and storage offset over a storage of as many elements as
    ``values``' own (the elements no value covers: a scale of one), so that an op given strides
    or a storage offset (``as_strided_``, ``resize_``) takes the same view of both: a scale
    kept once per channel or per tensor (broadcast, stride 0) has no memory such a view could
    cover.

    Example:
        >>> import torch
        >>> values = torch.zeros(4, dtype=torch.int8)[1:].view(3, 1)
        >>> s = scale_laid_out_as(torch.tensor(0.5), values)
        >>> s.stride(), s.storage_offset(), s.untyped_storage().nbytes() // 4
        ((1, 1), 1, 4)
    """
    count = values.untyped_storage().nbytes() // values.element_size()
    laid_out = torch.ones(count, dtype=scale.dtype, device=scale.device).as_strided(
        values.shape, values.stride(), values.storage_offset()
    )
    return laid_out.copy_(scale.expand(values.shape))
