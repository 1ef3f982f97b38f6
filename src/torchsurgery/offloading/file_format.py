"""Weights read from a checkpoint file into a narrower storage format as they are read.

With ``offload(storage=..., storage_dtype=...)`` a group streamed from the file keeps its
weights in the storage format, not the file's: a plain narrow dtype (``torch.bfloat16``,
``torch.float8_e4m3fn``) or a :class:`~torchsurgery.compact.Scaled` one (narrow values
and an fp32 scale per weight). Its bytes are read from the file as the file stores them
(:attr:`FileConversion.layout`) and converted, one weight at a time, into the group's own
layout (its values, then its scales): :meth:`FileConversion.convert` is the one place a
file's values become stored ones, for every read (the file reader's, the ring's plain
read). The conversion is the one an offload from memory makes of the same values: a cast
(``.to(dtype)``), or :meth:`Scaled.quantize <torchsurgery.compact.Scaled.quantize>` of the
values in the file's dtype, so both keep the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchsurgery.compact import Scaled
from torchsurgery.offloading.packing import FlatLayout, unpack
from torchsurgery.offloading.plan_types import ParamPlan

__all__ = ["FileConversion", "file_layout"]


@dataclass(frozen=True)
class FileConversion:
    """How a group's bytes in its checkpoint file become the values it keeps.

    Attributes:
        layout: the group's weights as the file stores them (its dtypes), in the group's
            order: what a read of the group fills.
        scaled: per weight, the scaled format it is quantised to (``None``: cast to its
            slot's dtype, or copied where that is the file's).
        scale_slots: per weight, the slot of the group's layout its scale takes (``None``: unscaled).

    Example:
        >>> import torch
        >>> from torchsurgery.offloading.packing import FlatLayout, pack, unpack
        >>> values = [torch.tensor([1.0, 1.00390625])]  # fp32 in the file; kept as bf16
        >>> stored = FlatLayout.of(values, [torch.bfloat16])
        >>> conversion = FileConversion(FlatLayout.of(values), (None,), (None,))
        >>> out = torch.empty(stored.nbytes, dtype=torch.uint8)
        >>> conversion.convert(pack(values, conversion.layout), out, stored)
        >>> unpack(out, stored)[0].tolist()  # rounded as .to(torch.bfloat16) rounds
        [1.0, 1.0]
    """

    layout: FlatLayout
    scaled: tuple[Scaled | None, ...]
    scale_slots: tuple[int | None, ...]

    def convert(self, raw: torch.Tensor, out: torch.Tensor, stored: FlatLayout) -> None:
        """``raw`` (the file's bytes, in :attr:`layout`) converted into ``out`` (the group's bytes, in
        ``stored``), weight by weight: no copy of the whole group is made on the way.

        ``out`` may be ``raw`` itself (converted in place): a weight is never kept in more bytes
        than the file stores it in, so in layout order each lands at or before its file bytes,
        never over those of a weight not converted yet; the scales, after every weight's values
        in ``stored``, are written last.
        """
        read, kept = unpack(raw, self.layout), unpack(out, stored)
        in_place = raw.data_ptr() == out.data_ptr()
        scales = []
        with torch.no_grad():
            for i, (values, fmt, at) in enumerate(zip(read, self.scaled, self.scale_slots, strict=True)):
                if fmt is None:  # the cast .to(dtype) makes (in place: from a copy, the two may overlap)
                    kept[i].copy_(values.clone() if in_place else values)
                else:
                    q, scale = fmt.quantize(values)
                    kept[i].copy_(q)
                    scales.append((at, scale))
            for at, scale in scales:
                assert at is not None
                kept[at].copy_(scale.reshape(kept[at].shape))


def _scale_shape(fmt: Scaled, shape: torch.Size) -> tuple[int, ...]:
    """The shape a weight's scale is kept in (as an offload from memory keeps it: one element per
    distinct scale, as many dimensions as the weight)."""
    first = shape[0] if fmt.per == "channel" and len(shape) >= 2 else 1
    return (first, *[1] * (len(shape) - 1))


def file_layout(
    source: Any, keys: Sequence[str], planned: Sequence[ParamPlan], params: Sequence[torch.Tensor]
) -> tuple[FlatLayout, FileConversion | None, tuple[torch.Tensor, ...]]:
    """A group streamed from ``source``: its layout, how its file bytes become it, and its scaled weights.

    The layout holds each weight in its storage dtype (``planned``, in order), then one fp32
    scale per scaled weight (each once, in the order returned). The conversion is ``None``
    where every weight is kept as the file stores it (its bytes are read straight into the
    layout).
    """
    dtypes = [p.storage_dtype for p in planned]
    file_dtypes = [source.locate(key)[3] for key in keys]
    scaled: dict[int, tuple[torch.Tensor, Scaled]] = {}
    for param, p in zip(params, planned, strict=True):
        if p.scaled is not None:
            scaled.setdefault(id(param), (param, p.scaled))
    scales = [torch.empty(_scale_shape(fmt, t.shape), device="meta") for t, fmt in scaled.values()]
    layout = FlatLayout.of([*params, *scales], [*dtypes, *[torch.float32] * len(scales)])
    if not scaled and file_dtypes == dtypes:
        return layout, None, ()
    at = {key: len(params) + i for i, key in enumerate(scaled)}
    conversion = FileConversion(
        FlatLayout.of(params, file_dtypes), tuple(p.scaled for p in planned), tuple(at.get(id(t)) for t in params)
    )
    return layout, conversion, tuple(t for t, _ in scaled.values())
