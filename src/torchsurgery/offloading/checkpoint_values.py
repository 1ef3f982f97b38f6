"""The values an offload reads from its checkpoint file (``offload(storage=...)``).

The file gives the weights streamed from it, the resident ones that have no values in the
model, and, on removal, the values of the weights that were ``meta`` while offloaded. A
scaled fp8 checkpoint (ComfyUI's layout) gives each such weight's values as ``q * scale``.
"""

from __future__ import annotations

import os
import zlib

import torch
from torch import nn

from torchsurgery._checkpoint import CheckpointError, SafetensorsSource, open_source
from torchsurgery.compact import dequantize
from torchsurgery.offloading.plan import OffloadPlan, ParamPlan, Residency
from torchsurgery.offloading.stats import storage_hint

__all__ = ["CheckpointValues"]

_WHAT = "torchsurgery.offload"


def _checksum(values: torch.Tensor) -> int:
    """A CRC-32 of ``values``' bytes."""
    return zlib.crc32(values.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data) if values.numel() else 0


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bits (NaNs included)."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True


class CheckpointValues:
    """The checkpoint an offload streams from, read by key.

    Attributes:
        source: the open checkpoint (a ``torchsurgery._checkpoint`` source).
        scales: the checkpoint's scaled fp8 weights: file key -> its scale's key.
        checksums: per file key of a weight that had values of its own, a CRC-32 of what the
            file held for it when the offload began (:meth:`check_holds`): :meth:`read_back`
            gives back only these values.

    Example:
        >>> import os, tempfile
        >>> import torch
        >>> from torch import nn
        >>> from safetensors.torch import save_file
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> save_file(model.state_dict(), path)
        >>> plan = torchsurgery.plan_offload(model, storage=path)
        >>> values = CheckpointValues.open(plan.storage, plan.params)
        >>> torch.equal(values.read("0.weight"), model[0].weight.detach())
        True
        >>> values.close()
    """

    def __init__(self, source: SafetensorsSource, params: list[ParamPlan]) -> None:
        self.source = source
        self.scales = {p.file_key: p.file_scale for p in params if p.file_key and p.file_scale}
        self.checksums: dict[str, int] = {}

    @classmethod
    def open(cls, storage: str | os.PathLike[str], params: list[ParamPlan]) -> CheckpointValues:
        """The checkpoint ``storage`` (a safetensors one: the plan checked it) for the weights ``params``."""
        source = open_source(storage, _WHAT)
        assert isinstance(source, SafetensorsSource)  # the plan checked it
        return cls(source, params)

    def scale(self, key: str) -> torch.Tensor:
        """The scale stored under ``key`` (ComfyUI's scaled fp8 layout), fp32, 0-dim, in host memory."""
        return self.source.read(key).float().reshape(())

    def read(self, key: str, *, check: bool = True) -> torch.Tensor:
        """The values the checkpoint holds under ``key``: a scaled fp8 weight's as ``q * scale`` (fp32).

        With ``check``, refused where a file changed since the offload opened it.
        """
        scale = self.scales.get(key)
        values = self.source.read(key, check=check)
        return values if scale is None else dequantize(values, self.scale(scale), torch.float32)

    def read_back(self, key: str) -> torch.Tensor:
        """The values a weight had when the offload began, read from the file for its removal.

        A file deleted or replaced since still gives them (the offload holds the original
        open). A file changed in place gives them where its bytes for ``key`` are still
        those checked at the start (the checksum says so; a file put back as it was passes).

        Raises:
            torchsurgery.CheckpointError: the file no longer holds them (nothing is given back).
        """
        values = self.read(key, check=False)
        if key in self.checksums and _checksum(values) != self.checksums[key]:
            raise CheckpointError(
                f"{_WHAT}: the checkpoint file no longer holds the values the model had for {key!r} (it was "
                "changed in place while offloaded), so they cannot be given back; put the original file back "
                "where it was and remove again (nothing changed)"
            )
        return values

    def check_holds(self, plan: OffloadPlan, named: dict[str, nn.Module]) -> None:
        """Refuse a checkpoint whose values differ from the model's own (a stale or other file).

        A weight with values is about to become ``meta``, and ``remove()`` would read it back
        from the file: before anything changes, the file must be proven to give back exactly
        what the model holds.
        """
        for p in plan.params:
            param = p.lookup_in(named)
            if p.residency is not Residency.FILE or p.tied_to is not None or param.is_meta:
                continue
            read = self.read(str(p.file_key))
            self.checksums[str(p.file_key)] = _checksum(read)
            stored = read.to(param.dtype)
            if stored.shape != param.shape or not _same_bytes(stored, param.detach()):
                raise ValueError(
                    f"{_WHAT}: {plan.storage!r} holds other values than the model for {p.name!r} "
                    f"(key {p.file_key!r}; a stale or different checkpoint, or one saved in a narrower dtype): "
                    "the model's own values would be lost when the offload is removed. Save the model's weights "
                    "to the file first, or offload without storage="
                )

    def hint(self, where: str) -> str:
        """:func:`~torchsurgery.offloading.stats.storage_hint` for the reads from the file so far."""
        return storage_hint(where, self.source.bytes_read, self.source.seconds_reading)

    def close(self) -> None:
        """Close the checkpoint."""
        self.source.close()
