"""The narrow copy of a master weight: kept fresh, viewed, or as a compiled graph holds it.

A weight offloaded with a master copy (``offload(master_dtype=...)``) keeps its master
values as :attr:`~torchsurgery.compact.OffloadedTensor.stored` and a narrow copy of them,
which serves forwards without gradients; these classes are that copy.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["Shadow", "ViewedShadow", "TracedShadow"]


class Shadow:
    """A narrow copy of master values, refreshed when the master changes (its version counter).

    Several threads may read it; one refreshes while the others wait for the fresh copy.
    """

    def __init__(self, master: torch.Tensor, dtype: torch.dtype) -> None:
        self.master = master
        self.copy = master.detach().to(dtype)
        self.version = master._version
        self._lock = threading.Lock()

    def current(self) -> torch.Tensor:
        """The narrow copy of the master values as they are now."""
        master = self.master
        if self.version != master._version:  # an optimizer step (or any in-place write) since
            with self._lock:
                if self.version != master._version:
                    self.copy.copy_(master.detach())
                    self.version = master._version
        return self.copy

    def follow(self, master: torch.Tensor) -> None:
        """Copy ``master`` from now on (the master values moved to new memory)."""
        with self._lock:
            self.master = master
            self.version = -1  # no version counter reads -1: copied again at the next read

    def __getstate__(self) -> dict[str, Any]:
        return {"master": self.master, "copy": self.copy, "version": self.version}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class ViewedShadow:
    """The narrow copy of a view of a master weight: the same view of the base's narrow copy."""

    def __init__(self, base: Shadow | TracedShadow | ViewedShadow, view: Any, args: Any, kwargs: dict[str, Any]) -> None:
        self.base, self.view, self.args, self.kwargs = base, view, args, kwargs

    @property
    def copy(self) -> torch.Tensor:
        """The view of the base's copy as it is now."""
        return self.current()

    def current(self) -> torch.Tensor:
        """The view of the base's copy, refreshed as the base is."""
        out: torch.Tensor = self.view(self.base.current(), *self.args, **self.kwargs)
        return out


class TracedShadow:
    """The narrow copy as ``torch.compile`` hands it to a graph: current when it was flattened.

    A compiled call flattens its weights at every call (``__tensor_flatten__``), which
    refreshes the :class:`Shadow` first, so the graph reads what eager would read.
    """

    def __init__(self, copy: torch.Tensor) -> None:
        self.copy = copy

    def current(self) -> torch.Tensor:
        """The narrow copy, as flattened."""
        return self.copy
