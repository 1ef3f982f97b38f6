"""A device shared by several models: ask for a model before use, the others make room.

A :class:`DevicePool` holds models for one device within a limit: a ``budget`` of bytes,
or ``keep_free`` bytes of the device left free. A model in the pool is either *on the
host* (as it was given) or *loaded*, through the :func:`~torchsurgery.offload` engine:
whole when it fits, or partly resident with the rest streamed group by group when it
does not. :meth:`DevicePool.load` first pushes back the other loaded models, least
recently used first (a forward counts as a use), until the model fits whole or nothing
is left to push back.

Nothing here moves a tensor itself: loading is an ``offload`` and pushing back is its
exact undo, so parameters keep their identity and every step is in the model's undo
log (a pool entry, and above it the offload while loaded); ``torchsurgery.restore``
takes a model out of its pool.

Sizes are counted as the weights take them on the device, as the offload's budget counts
them: in their storage dtype (the compute dtype where none is given), and the widest
weight stored in another dtype than it computes in once more, widened for a product; the device
footprint of a streamed model is its resident groups plus ``prefetch + 1`` of its largest
group in flight. The device is the CPU or the accelerator PyTorch reports
(``torch.accelerator``: CUDA, ROCm, XPU, MPS or a registered backend), whose free memory
comes from its own statistics. On a CPU device the limit works the same way (the
"device" is host memory holding the weights as loaded); ``keep_free`` there is
measured against the host's available memory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._device import (
    AcceleratorDevice,
    accelerator_device,
    reported_accelerator,
)
from torchsurgery._validate import check_bytes, check_device, check_dtype
from torchsurgery.compact import Scaled
from torchsurgery.offloading.engine import DEFAULT_SKIP, OffloadHandle
from torchsurgery.offloading.host_tier import HostAccount
from torchsurgery.offloading.plan import already_offloaded, check_storage_format
from torchsurgery.offloading.pool_members import Fallback, Member, Members, Touch
from torchsurgery.offloading.stats import OffloadStats

__all__ = ["DevicePool", "PoolStats"]

_WHAT = "torchsurgery.DevicePool"
_Touch = Touch  # the hook's name before 0.2: a model pickled while in a pool refers to it


@dataclass
class PoolStats:
    """What one model of a pool did so far.

    Attributes:
        name: the model's name in the pool.
        state: ``"host"``, ``"whole"`` (every weight on the device) or ``"partial"``.
        total_bytes: what the model takes on the device kept whole: its weights as stored
            (see the module's docs).
        largest_group_bytes: its largest offload group, as stored.
        device_bytes: what the pool counts the model as taking on the device now.
        loads: how often it was brought to the device.
        pushed_back: how often it went back to the host to make room for another model.
        seconds_loading: time spent in :meth:`DevicePool.load` and :meth:`DevicePool.unload`.
        offload: the statistics of its current offload (``None`` on the host).

    Example:
        >>> from torch import nn
        >>> import torchsurgery
        >>> pool = torchsurgery.DevicePool("cpu", budget=1 << 20)
        >>> model = pool.add(nn.Linear(4, 4), name="proj")
        >>> _ = pool.load(model)
        >>> s = pool.stats()["proj"]
        >>> s.state, s.total_bytes, s.loads
        ('whole', 80, 1)
    """

    name: str
    state: str
    total_bytes: int
    largest_group_bytes: int
    device_bytes: int
    loads: int
    pushed_back: int
    seconds_loading: float
    offload: OffloadStats | None


class _NoRoom(RuntimeError):
    """Even with every other model pushed back, a model cannot run on the device."""


class PoolRecord(_undo.Record):
    """The undo-log entry of a model held by a pool: undoing it takes the model out.

    A copy of the model is in no pool: its copy of the record is detached (``pool`` is
    ``None``); undoing that removes the record and the copy's detached hook.
    """

    kind = "pool"

    def __init__(self, pool: DevicePool | None, name: str) -> None:
        super().__init__()
        self.pool = pool
        self.name = name

    def describe(self) -> str:
        where = f"the device pool of {self.pool.device}" if self.pool is not None else "a copy of a pooled model (in no pool)"
        return f"in {where} as {self.name!r}"

    def undo(self, module: nn.Module) -> None:
        if self.pool is not None:
            self.pool.discard(module)
            return
        hooks = module._forward_pre_hooks
        for key in [k for k, h in hooks.items() if isinstance(h, Touch) and h.members is None]:
            del hooks[key]
        _undo.remove(module, self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_detached_record, (self.name, self.seq))


def _detached_record(name: str, seq: int) -> PoolRecord:
    record = PoolRecord(None, name)
    record.seq = seq
    return record




class DevicePool:
    """Several models sharing one device within a limit; least recently used go back first.

    Args:
        device: the shared device: ``"cpu"`` or the accelerator PyTorch reports (``"cuda"``,
            ``"cuda:1"``, ``"xpu"``, ...); ``None``: that accelerator.
        budget: device bytes all loaded models may take together.
        keep_free: instead of a budget: load only while this many bytes of the device
            stay free (measured when loading). Without either, an accelerator pool may use
            what is free, and a CPU pool is unlimited.
        on_fallback: told ``(model, sentence)`` of the finer groups a model streams where, without a ``budget``, its
            room is too small for its own, or without a ``host_budget`` the host for the read buffers of a
            checkpoint's groups (default: a warning; a budget refuses).
        host_budget: host bytes of weights streamed from checkpoints (``add(storage=...)``) kept in memory,
            all models together (:func:`~torchsurgery.offload`'s host tier; given back when a model is pushed back).

    Raises:
        ValueError: a device that does not exist, both limits, or a negative one.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> pool = torchsurgery.DevicePool("cpu", budget=1000)  # a model takes 832 bytes whole in bf16
        >>> a = pool.add(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), name="a", storage_dtype=torch.bfloat16, dtype=torch.float32)
        >>> b = pool.add(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), name="b", storage_dtype=torch.bfloat16, dtype=torch.float32)
        >>> _ = pool.load(a), pool.load(b)  # b does not fit next to a: a goes back to the host
        >>> from torchsurgery.offloading import stored_values
        >>> pool.state(a), pool.state(b), stored_values(a[3].weight).dtype, stored_values(b[3].weight).dtype
        ('host', 'whole', torch.float32, torch.bfloat16)
        >>> with torch.no_grad():
        ...     _ = a(torch.ones(1, 8)), b(torch.ones(1, 8))
        >>> pool.close()
    """

    def __init__(self, device: str | torch.device | None = None, *, budget: int | None = None, keep_free: int | None = None,
                 on_fallback: Callable[[nn.Module, str], None] | None = None, host_budget: int | None = None) -> None:
        self._device = _pool_device(device)  # its index, free memory, allocation rounding
        self.device = self._device.device
        self.budget = check_bytes(budget, _WHAT, "budget")
        self.keep_free = check_bytes(keep_free, _WHAT, "keep_free")
        if self.budget is not None and self.keep_free is not None:
            raise ValueError(f"{_WHAT}: give budget= or keep_free=, not both")
        self.host = HostAccount(host_budget)  # shared by the members' offloads (public: its budget may change)
        self._members = Members(_WHAT, Fallback.maker(on_fallback) if self.budget is None else None)
        self._host_fallback = Fallback.maker(on_fallback) if host_budget is None else None
        self._placement = _Placement(self, self._device, self._members)

    def add(
        self, model: nn.Module, *, name: str | None = None, dtype: torch.dtype | None = None,
        storage_dtype: torch.dtype | Scaled | None = None, groups: str | Sequence[str] = "blocks",
        skip: Callable[[nn.Module, str], bool] | None = DEFAULT_SKIP, prefetch: int = 1,
        pin_memory: bool | None = None, storage: str | os.PathLike[str] | None = None,
        host_budget: int | HostAccount | None = None,
    ) -> nn.Module:
        """Put ``model`` in the pool, on the host until :meth:`load` asks for it.

        Args:
            model: the model (changed in place when loaded; nothing is copied).
            name: its name in :meth:`stats` (default: its class name, numbered if taken).
            dtype: compute dtype, as for :func:`~torchsurgery.offload`.
            storage_dtype: storage dtype while loaded, resident or streamed, as for :func:`~torchsurgery.offload` (or ``Scaled``).
            groups: offload groups, as for :func:`~torchsurgery.offload`.
            skip: modules that keep their dtype, as for :func:`~torchsurgery.offload`.
            prefetch: groups brought in ahead when streamed.
            pin_memory: pin streamed host storage (default: on an accelerator).
            storage: a safetensors checkpoint to stream a model (a skeleton too) from, within ``host_budget``.
            host_budget: with ``storage``: the model's own host budget (bytes or an account), not the pool's.

        Returns:
            ``model``.

        Raises:
            TypeError: a ``dtype`` or ``storage_dtype`` :func:`~torchsurgery.offload` refuses.
            ValueError: the model is in a pool already, the name is taken, or the budget is below what it needs streamed.
            RuntimeError: the model is offloaded already (by torchsurgery, accelerate or diffusers), or the device is gone.
        """
        _refuse_if_gone(self._device, "add")
        _check_addable(self, model, dtype, storage_dtype)
        name = self._members.name_for(model, name)
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"{_WHAT}.add: prefetch must be an int >= 0, got {prefetch!r}")
        options = {"dtype": dtype, "storage_dtype": storage_dtype, "groups": groups, "skip": skip, "prefetch": prefetch,
                   "pin_memory": pin_memory, "master_dtype": None, "storage": storage, "host_budget": self.host if host_budget is None else _host_account(host_budget)}
        member = Member(model, name, options, self._device, _WHAT)
        _check_budget(self.budget, member)
        self._members.join(model, member)
        member.host_fallback = self._host_fallback(member) if storage and host_budget is None and self._host_fallback else None
        member.record = PoolRecord(self, name)
        _undo.push(model, member.record)
        return model

    def discard(self, model: nn.Module) -> nn.Module:
        """Take ``model`` out of the pool, back on the host as it was added.

        The same parameter objects in their dtypes; after a load with a ``storage_dtype``
        their values keep its rounding, as after :meth:`~torchsurgery.OffloadHandle.remove`.

        Returns:
            ``model``.
        """
        self._members.find(model, "discard").push_back()
        member = self._members.leave(model)
        if member.record is not None:
            _undo.remove(model, member.record)
        return model

    def close(self) -> None:
        """Discard every model (also when the device is gone: the models are on the host then)."""
        for member in self._members:
            self.discard(member.model)

    def load(self, model: nn.Module, *, keep_free: int | None = None) -> OffloadHandle:
        """Bring ``model`` to the device: whole if it fits, else partly, others pushed back.

        Other loaded models go back to the host, least recently used first, until
        ``model`` fits whole or none is left; then it is loaded whole, or with as many
        groups resident as the room allows and the rest streamed. A model loaded
        already is only marked used, unless more room has become available for it
        (it is then planned again).

        Args:
            model: a model of this pool.
            keep_free: for this load, also leave this many device bytes free (instead
                of the pool's ``keep_free``; a budget still applies).

        Returns:
            The model's :class:`~torchsurgery.OffloadHandle`.

        Raises:
            ValueError: the model is not in this pool.
            RuntimeError: even with every other model pushed back, the room is below what
                the model needs streamed (nothing is changed then; unless, on an accelerator,
                the models pushed back turn out to have held less than they were granted:
                they stay on the host), or the device is gone.
        """
        member = self._member(model, "load")
        handle = self._placement.load(member, check_bytes(keep_free, _WHAT, "keep_free"))
        self._members.touch(member)
        return handle

    def shrink(self, model: nn.Module, *, keep_free: int) -> OffloadHandle | None:
        """Leave ``keep_free`` bytes of the device free by taking back only as much of ``model`` as needed.

        No other model is pushed back. A model that is on the host, or leaves that much free
        already, stays as it is; otherwise it is planned again with what is left as its
        budget (fewer groups resident, the rest streamed), or goes back to the host when that
        is below what it needs streamed.

        Returns:
            The model's :class:`~torchsurgery.OffloadHandle`, or ``None`` when it is on the host.

        Example:
            >>> from torch import nn
            >>> import torchsurgery
            >>> pool = torchsurgery.DevicePool("cpu", budget=1 << 20)
            >>> model = pool.add(nn.Linear(4, 4))
            >>> _ = pool.load(model)
            >>> pool.shrink(model, keep_free=1 << 62) is None, pool.state(model)
            (True, 'host')
            >>> pool.close()
        """
        return self._placement.shrink(self._member(model, "shrink"), check_bytes(keep_free, _WHAT, "keep_free"))

    def try_load(self, model: nn.Module, *, keep_free: int | None = None) -> OffloadHandle | None:
        """:meth:`load`, or ``None`` (nothing changed) when even streamed the model has no room.

        Example:
            >>> from torch import nn
            >>> import torchsurgery
            >>> pool = torchsurgery.DevicePool("cpu", budget=1 << 20)
            >>> model = pool.add(nn.Linear(4, 4))
            >>> pool.try_load(model, keep_free=1 << 62) is None, pool.state(model)
            (True, 'host')
            >>> pool.close()
        """
        try:
            return self.load(model, keep_free=keep_free)
        except _NoRoom:
            return None

    def free_bytes(self) -> int:
        """Bytes a new allocation on the pool's device can take now.

        On an accelerator: what the device reports free plus what torch's caching allocator
        holds unused. On a CPU: the host's available memory.

        Example:
            >>> import torchsurgery
            >>> torchsurgery.DevicePool("cpu").free_bytes() > 0
            True
        """
        return self._device.available_bytes()

    @staticmethod
    def holding(model: nn.Module) -> DevicePool | None:
        """The pool ``model`` is in, if any.

        Example:
            >>> from torch import nn
            >>> import torchsurgery
            >>> pool = torchsurgery.DevicePool("cpu")
            >>> model = pool.add(nn.Linear(2, 2))
            >>> torchsurgery.DevicePool.holding(model) is pool, torchsurgery.DevicePool.holding(nn.Linear(2, 2))
            (True, None)
            >>> pool.close()
        """
        for record in _undo.records(model):
            if isinstance(record, PoolRecord) and record.pool is not None:
                return record.pool
        return None

    def unload(self, model: nn.Module) -> nn.Module:
        """Push ``model`` back to the host (a no-op when it is there).

        Returns:
            ``model``.
        """
        self._member(model, "unload").push_back()
        return model

    def unload_all(self) -> None:
        """Push every model back to the host."""
        for member in self._members:
            member.push_back()

    def state(self, model: nn.Module) -> str:
        """``"host"``, ``"whole"`` or ``"partial"``."""
        return self._member(model, "state").state

    @property
    def models(self) -> list[nn.Module]:
        """The models of the pool, in the order they were added."""
        return [m.model for m in self._members]

    def stats(self) -> dict[str, PoolStats]:
        """Per model (by name): state, sizes, loads, push-backs, time, offload statistics."""
        return {m.name: _stats_of(m, self._member(m.model, "state").state) for m in self._members}

    def __contains__(self, model: object) -> bool:
        return model in self._members

    def __repr__(self) -> str:
        limit = f"budget={self.budget}" if self.budget is not None else f"keep_free={self.keep_free}"
        return f"DevicePool({str(self.device)!r}, {limit}, models={self._members.names()})"

    def _member(self, model: Any, what: str) -> Member:
        _refuse_if_gone(self._device, what)
        return self._members.find(model, what)


class _Placement:
    """Which models are on the device and how much of it each takes: loading a model within
    the pool's limits, pushing back others (least recently used first) to make room.

    The limits: a ``budget``, or ``keep_free`` bytes left free (an accelerator pool without
    either takes what is free, a CPU pool without either is unlimited), read against what the
    other loaded models were granted and what the device reports free.
    """

    def __init__(self, limits: DevicePool, device: AcceleratorDevice, members: Members) -> None:
        self.limits = limits  # its budget and keep_free, read at each use (public: a caller may change them)
        self.device = device
        self.members = members

    def load(self, member: Member, keep: int | None) -> OffloadHandle:
        """:meth:`DevicePool.load` of ``member``, leaving ``keep`` bytes free (``None``: the pool's limit)."""
        if member.handle is None:  # on the host: sized again (surgery since may have added or converted weights)
            member.size()
        room, reclaimable = self.room(member, keep)
        handle = member.handle
        if handle is not None:
            # room is what is free beyond the model's own bytes: plan again only for a
            # different keep_free, or when at least one more group would fit
            if member.granted >= member.total or (keep == member.keep_free and room < member.largest):
                return handle
            room += member.granted
        if room + reclaimable < min(member.total, member.minimum):
            raise _no_room(member, room + reclaimable, self.device.device, after_push_back=False)
        start = time.perf_counter()
        for other in self.members.loaded(but=member):  # least recently used first
            if room >= member.total:
                break
            room += other.granted
            other.push_back()
            other.pushed_back += 1
        member.push_back()
        room = self.measured(member, room, keep)
        if room < min(member.total, member.minimum):
            raise _no_room(member, room, self.device.device, after_push_back=True)
        handle = member.offload(member.total if room >= member.total else room, keep)
        member.seconds += time.perf_counter() - start
        return handle

    def shrink(self, member: Member, keep: int | None) -> OffloadHandle | None:
        """:meth:`DevicePool.shrink` of ``member``, to leave ``keep`` bytes free."""
        handle = member.handle
        if handle is None:
            return None
        room = self.device.available_bytes() - int(keep or 0) + member.granted
        if room >= member.granted:
            return handle
        start = time.perf_counter()
        member.push_back()
        room = self.measured(member, room, keep)
        handle = member.offload(room, keep) if room >= min(member.total, member.minimum) else None
        member.seconds += time.perf_counter() - start
        return handle

    def room(self, member: Member, keep_free: int | None) -> tuple[int, int]:
        """Device bytes free for ``member`` now, and what pushing back the others would add."""
        reclaimable = sum(m.granted for m in self.members.loaded(but=member))
        budget = self.limits.budget
        keep = keep_free if keep_free is not None else self.limits.keep_free
        limits = []
        if budget is not None:
            limits.append(budget - reclaimable - (member.granted if member.loaded else 0))
        if keep is not None or (budget is None and not self.device.host_compute):
            limits.append(self.device.available_bytes() - (keep or 0))
        room = min(limits) if limits else 1 << 62  # a CPU pool without a limit is unlimited
        return max(0, room), reclaimable

    def measured(self, member: Member, room: int, keep: int | None) -> int:
        """``room`` for ``member`` once models were pushed back, read again from the accelerator's
        free memory: a model holds less than the pool granted it (until its first forward, and
        where that forward's measurements keep fewer groups resident than the grant would hold),
        so counting its grant as freed would plan past ``keep``. On a CPU the count stands:
        pushing a model back there converts its weights back, it frees no memory to measure."""
        if self.device.host_compute:
            return room
        return min(room, self.room(member, keep)[0])


def _stats_of(member: Member, state: str) -> PoolStats:
    """What ``member`` did so far, in ``state``."""
    handle = member.handle
    return PoolStats(
        name=member.name, state=state, total_bytes=member.total, largest_group_bytes=member.largest,
        device_bytes=member.granted if handle is not None else 0, loads=member.loads, pushed_back=member.pushed_back,
        seconds_loading=member.seconds, offload=handle.stats() if handle is not None else None,
    )


def _pool_device(device: str | torch.device | None) -> AcceleratorDevice:
    """A pool's device: ``device``, or (``None``) the accelerator PyTorch reports, on its current index."""
    if device is None:
        device = reported_accelerator()
        if device is None:
            raise ValueError(f"{_WHAT}: PyTorch reports no accelerator for the default device; give device='cpu'")
    target = check_device(device, _WHAT)
    if target is None or target.type == "meta":
        raise ValueError(f"{_WHAT}: device {device!r} holds no values; give 'cpu' or the accelerator PyTorch reports")
    return accelerator_device(target, _WHAT)


def _refuse_if_gone(device: AcceleratorDevice, what: str) -> None:
    """Refuse work on a pool whose device PyTorch stopped reporting."""
    gone = device.missing()
    if gone:
        raise RuntimeError(
            f"{_WHAT}.{what}: the pool's device {device.device} is gone ({gone}); its models are left as they "
            "are: call close() to take them out of the pool"
        )


def _no_room(member: Member, room: int, device: torch.device, after_push_back: bool) -> _NoRoom:
    """The error of a load that has too little room for ``member`` even streamed."""
    needs = f"{_WHAT}.load: {member.name!r} needs {member.total} bytes whole or {member.minimum} streamed on {device}, "
    if after_push_back:
        return _NoRoom(
            f"{needs}but with the other models pushed back only {room} bytes are free; free memory on the device "
            "or lower keep_free"
        )
    return _NoRoom(f"{needs}but only {room} bytes can be made free; free memory on the device, lower keep_free or raise the budget")


def _check_addable(pool: DevicePool, model: nn.Module, dtype: Any, storage_dtype: Any) -> None:
    """Refuse a model :meth:`DevicePool.add` cannot take, or options it cannot offload with."""
    what = f"{_WHAT}.add"
    _undo.check_module(model, what)
    check_dtype(dtype, what, "dtype")
    check_storage_format(storage_dtype, what)
    for record in _undo.records(model):
        if isinstance(record, PoolRecord) and record.pool is None:
            record.undo(model)  # a copy of a pooled model: the record it carried is stale
        elif isinstance(record, PoolRecord) and record.pool is not None:
            where = "this pool" if record.pool is pool else f"the pool of {record.pool.device}"
            raise ValueError(
                f"{what}: the model is already in {where} as {record.name!r}; "
                f"a model belongs to one pool: discard it there first"
            )
    problem = already_offloaded(model)
    if problem:
        raise RuntimeError(f"{what}: cannot pool the model: {problem}")


def _host_account(host_budget: int | HostAccount) -> HostAccount:
    """A model's own host budget as an account (refused if not a byte count)."""
    if isinstance(host_budget, HostAccount):
        return host_budget
    return HostAccount(check_bytes(host_budget, f"{_WHAT}.add", "host_budget"))


def _check_budget(budget: int | None, member: Member) -> None:
    """Refuse a member the pool's budget cannot run even streamed."""
    if budget is not None and budget < min(member.total, member.minimum):
        prefetch = member.options["prefetch"]
        raise ValueError(
            f"{_WHAT}.add: budget={budget} bytes is below what {member.name!r} needs on the device: "
            f"{member.total} bytes whole, or {member.minimum} bytes streamed (prefetch + 1 = {prefetch + 1} "
            f"ring slots for its largest group, {member.largest} bytes, and a run's casts); raise the budget, or "
            "add it with groups='leaves' or prefetch=0"
        )
