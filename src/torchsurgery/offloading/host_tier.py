"""The host tier: how many bytes of a checkpoint's weights stay in host memory, and which.

Weights streamed from a checkpoint file (``offload(storage=...)``) sit in one of three
tiers: *device* (resident), *host* (read from the file once, then kept in host memory,
pinned where a device copies from them) or *disk* (read from the file on every forward).
A :class:`HostAccount` holds the host budget; one account can serve several offloads (a
:class:`~torchsurgery.DevicePool`'s models share one). Without a ``host_budget``, the budget
is the memory the system reports available (``MemAvailable``) minus a margin, never more.

Until a forward has run, the host tier takes the streamed groups in the order they are read,
first first, while they fit: a group read early in a forward is the one whose read nothing
earlier could hide. The first forward measures how long each group's read kept the model
waiting; from then on the host tier keeps the groups that kept it waiting longest for their
bytes (:func:`fill`). Where the budget ends inside a group, the host keeps that group's
first bytes and reads the rest (tier ``"split"``), so the whole budget saves reads.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from typing import Any

from torchsurgery._device import host_available_memory
from torchsurgery._validate import check_bytes

__all__ = ["HostAccount", "available_memory", "default_host_budget", "assign_tiers", "fill", "tier_of", "retier", "MARGIN"]

_WHAT = "torchsurgery.offload"

MARGIN = 2 << 30
"""Bytes of available memory the default host budget leaves to everything else."""


def available_memory() -> int:
    """Host memory the system reports available now (``MemAvailable``; else free pages), in bytes.

    Example:
        >>> available_memory() > 0
        True
    """
    return host_available_memory()


def default_host_budget() -> int:
    """The host budget when none is given: available memory minus :data:`MARGIN`, at least 0.

    Example:
        >>> default_host_budget() <= available_memory()
        True
    """
    return max(0, available_memory() - MARGIN)


class HostAccount:
    """A host budget, and the bytes each offload holds of it now (thread-safe).

    Args:
        budget: host bytes the kept weights may take together (``None``: :func:`default_host_budget`).

    Example:
        >>> account = HostAccount(100)
        >>> account.reserve("a", 60), account.reserve("b", 60), account.free_bytes()
        (True, False, 40)
        >>> account.release("a"); account.free_bytes()
        100
    """

    def __init__(self, budget: int | None = None) -> None:
        checked = check_bytes(budget, _WHAT, "host_budget")
        self.budget = default_host_budget() if checked is None else checked
        self._held: dict[Any, int] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # a copy (pickle, deepcopy, torch.save of a model whose offload keeps this account, a pool's)
        # gets an account of its own with the same budget and nothing held: what the original's
        # offloads hold stays theirs, and a lock is not copied
        return {"budget": self.budget}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.budget = state["budget"]
        self._held = {}
        self._lock = threading.Lock()

    def free_bytes(self) -> int:
        """Bytes of the budget nobody holds."""
        with self._lock:
            return self.budget - sum(self._held.values())

    def held(self, owner: Any) -> int:
        """Bytes ``owner`` holds."""
        with self._lock:
            return self._held.get(owner, 0)

    def reserve(self, owner: Any, nbytes: int) -> bool:
        """Take ``nbytes`` more for ``owner`` if they fit in the budget; whether they did."""
        with self._lock:
            if sum(self._held.values()) + nbytes > self.budget:
                return False
            self._held[owner] = self._held.get(owner, 0) + nbytes
            return True

    def give(self, owner: Any, nbytes: int) -> None:
        """Give back ``nbytes`` of what ``owner`` holds."""
        with self._lock:
            left = self._held.get(owner, 0) - nbytes
            if left > 0:
                self._held[owner] = left
            else:
                self._held.pop(owner, None)

    def release(self, owner: Any) -> None:
        """Give back all ``owner`` holds."""
        with self._lock:
            self._held.pop(owner, None)


def host_budget_of(value: int | HostAccount | None) -> int:
    """The host bytes an offload may keep: ``value``'s free part for an account, else ``value``
    checked (``None``: :func:`default_host_budget`)."""
    if isinstance(value, HostAccount):
        return value.free_bytes()
    checked = check_bytes(value, _WHAT, "host_budget")
    return default_host_budget() if checked is None else checked


def _stored_bytes(group: Any) -> int:
    """The bytes of ``group``'s weights as the host keeps them: as its checkpoint stores them, or in the
    ``storage_dtype`` they are converted to, a scale included (a weight tied within it once)."""
    names = {p.name for p in group.params}
    return sum(p.nbytes // p.compute_dtype.itemsize * p.storage_dtype.itemsize + p.scale_nbytes
               for p in group.params if p.tied_to is None or p.tied_to not in names)


def fill(sizes: Sequence[tuple[str, int]], room: int, whole_only: Collection[str] = ()) -> dict[str, int]:
    """The bytes kept of each of ``sizes`` (name, bytes), taken in the order given, within ``room``.

    Whole while they fit (one that does not is passed over for the next); the first one left
    out then takes what room is left: its first bytes (not one of ``whole_only``: a group
    converted as it is read is kept converted, whole, or not at all).

    Example:
        >>> fill([("a", 40), ("b", 50), ("c", 10)], 80)
        {'a': 40, 'c': 10, 'b': 30}
    """
    kept: dict[str, int] = {}
    for name, nbytes in sizes:
        if 0 < nbytes <= room:
            kept[name] = nbytes
            room -= nbytes
    part = next((name for name, nbytes in sizes if name not in kept and name not in whole_only and nbytes > 0), None)
    if part is not None and room > 0:
        kept[part] = room
    return kept


def assign_tiers(groups: Sequence[Any], host_budget: int | HostAccount | None, from_file: bool) -> int:
    """Set each group's ``tier`` and ``host_bytes``: ``"device"`` (resident), ``"host"``,
    ``"split"`` or ``"disk"``.

    Groups held in memory stream from the host. Of those streamed from a checkpoint file, the
    first ones in model order (the order a forward reads them in, until one has run) stay in
    host memory while their bytes fit ``host_budget`` (:func:`fill`); the rest are read on
    every forward, the first of them in part where the budget ends inside it.

    Returns:
        The host budget (checked; the free part of an account).
    """
    budget = host_budget_of(host_budget)
    streamed = [g for g in groups if not g.resident]
    converted = {g.name for g in streamed if any(p.converts for p in g.params)}
    kept = fill([(g.name, _stored_bytes(g)) for g in streamed], budget, converted) if from_file else {}
    for g in groups:
        g.host_bytes = kept.get(g.name, 0)
        if g.resident:
            g.tier = "device"
        elif not from_file:
            g.tier = "host"
        else:
            g.tier = tier_of(g.host_bytes, _stored_bytes(g))
    return budget


def tier_of(kept: int, nbytes: int) -> str:
    """The tier of a group streamed from a file of which the host keeps ``kept`` of its ``nbytes``.

    Example:
        >>> tier_of(0, 10), tier_of(4, 10), tier_of(10, 10)
        ('disk', 'split', 'host')
    """
    return "disk" if kept <= 0 else "host" if kept >= nbytes else "split"


def retier(groups: Sequence[Any], kept: dict[str, int]) -> None:
    """Set the tiers of ``groups`` streamed from a checkpoint file to what the host keeps of
    each now (``kept``: bytes by name; after the first forward's measurements)."""
    for g in groups:
        if g.tier in ("host", "split", "disk"):
            g.host_bytes = kept.get(g.name, 0)
            g.tier = tier_of(g.host_bytes, _stored_bytes(g))
