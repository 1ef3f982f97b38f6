"""What an offload changed: every tensor it swapped, where it was, and what gives it back.

The offload swaps new contents into existing tensors (their identity stays); this ledger
records each one once, before its first change, and computes what ``remove()`` swaps back:
its values on its device in its dtype (read back from the checkpoint file where it was
``meta`` while offloaded).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from torchsurgery._swap import wrap_like
from torchsurgery.compact import OffloadedTensor, offloaded_like, stored_values
from torchsurgery.offloading.checkpoint_values import CheckpointValues

__all__ = ["Original", "Originals"]


@dataclass(eq=False)
class Original:
    """Where a tensor was before the offload, and where its values are if it became meta.

    Attributes:
        name: its qualified name.
        tensor: the tensor itself.
        device: the device it was on (as it read).
        dtype: the dtype it had (as it read).
        file_key: its key in the checkpoint file, where it became meta.
        kept: the dtype its values were kept in, where it read as another (an installer's).
        kept_on: the device its values were kept on, where it read as another.
    """

    name: str
    tensor: torch.Tensor
    device: torch.device
    dtype: torch.dtype
    file_key: str | None = None
    kept: torch.dtype | None = None
    kept_on: torch.device | None = None


class Originals:
    """Every tensor an offload changed, in order, each with where it was.

    Example:
        >>> import torch
        >>> weight = torch.ones(2)
        >>> ledger = Originals()
        >>> ledger.remember("w", weight)
        >>> ledger.remember("w", weight)  # once while installing
        >>> weight.data = weight.data.half()
        >>> [(t is weight, back.dtype) for t, back in ledger.restored_values(None)]
        [(True, torch.float32)]
    """

    def __init__(self) -> None:
        self.entries: list[Original] = []
        self._seen: set[int] = set()  # ids of the tensors in entries, while installing

    def __iter__(self) -> Iterator[Original]:
        return iter(self.entries)

    def remember(self, name: str, tensor: torch.Tensor, file_key: str | None = None) -> None:
        """Record ``tensor`` as it is now, before its first change (once while installing)."""
        if id(tensor) not in self._seen:
            self._seen.add(id(tensor))
            wrapped = isinstance(tensor, OffloadedTensor)
            kept, kept_on = (stored_values(tensor).dtype, stored_values(tensor).device) if wrapped else (None, None)
            self.entries.append(Original(name, tensor, tensor.device, tensor.dtype, file_key, kept, kept_on))

    def installed(self) -> None:
        """The installation ended: the ids seen while installing are forgotten."""
        self._seen = set()

    def clear(self) -> None:
        """Forget every entry (they were given back)."""
        self.entries.clear()

    def restored_values(self, file: CheckpointValues | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each changed tensor with what is swapped back into it: its values on its device, in its
        dtype (kept as they were kept where it read as another dtype); changes nothing.

        ``file`` gives the values of the tensors that became ``meta`` (streamed from it).
        """
        restored: list[tuple[torch.Tensor, torch.Tensor]] = []
        for o in reversed(self.entries):
            tensor, dtype = o.tensor, o.kept or o.dtype
            meta = stored_values(tensor).is_meta
            if meta and o.device.type == "meta":  # a skeleton's weight: meta it was, meta it stays
                if isinstance(tensor, OffloadedTensor):  # it read as the device it computed on
                    restored.append((tensor, wrap_like(tensor, torch.empty(tensor.shape, dtype=o.dtype, device="meta"))))
                continue
            where = o.kept_on or o.device
            if meta:  # its values are in the checkpoint file it was streamed from
                assert file is not None and o.file_key is not None
                data = file.read_back(o.file_key).to(device=where, dtype=dtype)
            else:
                data = tensor.detach().to(device=where, dtype=dtype, copy=True)
            back = wrap_like(tensor, data) if o.kept is None else offloaded_like(tensor, data, o.dtype, device=o.device)
            restored.append((tensor, back))
        return restored
