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

import itertools
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._validate import check_bytes, check_device, check_dtype
from torchsurgery.compact import Scaled
from torchsurgery.offloading.device import resolve_device
from torchsurgery.offloading.engine import (
    DEFAULT_SKIP,
    OffloadHandle,
    OffloadRecord,
    offload_converted,
)
from torchsurgery.offloading.plan import already_offloaded, check_storage_format, sizes
from torchsurgery.offloading.stats import OffloadStats

__all__ = ["DevicePool", "PoolStats"]

_WHAT = "torchsurgery.DevicePool"


def _free_bytes(device: torch.device) -> int:
    """Bytes a new allocation on ``device`` can take now.

    On an accelerator: what the device reports free plus what torch's caching allocator
    holds unused. On a CPU: the host's available memory (``MemAvailable``).
    """
    if device.type != "cpu":
        free, _ = torch.accelerator.get_memory_info(device)
        stats = torch.accelerator.memory_stats(device)
        return int(free + stats.get("reserved_bytes.all.current", 0) - stats.get("active_bytes.all.current", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _accelerator() -> torch.device | None:
    """The accelerator PyTorch reports, if one is available."""
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None


def _device_gone(device: torch.device) -> str | None:
    if device.type == "cpu":
        return None
    accelerator = _accelerator()
    if accelerator is None or accelerator.type != device.type:
        return f"this PyTorch reports {'no accelerator' if accelerator is None else repr(accelerator.type)}"
    count = torch.accelerator.device_count()
    if (device.index or 0) >= count:
        return f"there are only {count} {device.type} devices"
    return None


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


class _Entry:
    """A model's place in a pool. It holds the model weakly (a model its owner drops is freed
    and leaves the pool) and finds the model's offload in the model's undo log."""

    def __init__(
        self, model: nn.Module, name: str, options: dict[str, Any], total: int, largest: int, streamed: int
    ) -> None:
        self.ref = weakref.ref(model)
        self.name = name
        self.options = options
        self.total = total
        self.largest = largest
        self.streamed = streamed
        self.granted = 0  # device bytes counted against the limit while loaded
        self.keep_free: int | None = None  # what the current load was planned for
        self.last_used = 0
        self.loads = 0
        self.pushed_back = 0
        self.seconds = 0.0
        self.hook: Any = None
        self.record: PoolRecord | None = None
        # parameters (by id) the user converted with .to(dtype) while loaded, to the dtype:
        # later loads plan them in it
        self.converted: dict[int, torch.dtype] = {}

    @property
    def model(self) -> nn.Module:
        model = self.ref()
        assert model is not None, "entries of dropped models leave the pool"
        return model

    @property
    def handle(self) -> OffloadHandle | None:
        """The model's active offload (one undone from outside leaves the model on the host)."""
        model = self.ref()
        found = next((r for r in _undo.records(model) if isinstance(r, OffloadRecord)), None) if model is not None else None
        return found.handle if found is not None and found.handle.active else None

    @property
    def loaded(self) -> bool:
        return self.handle is not None

    @property
    def minimum(self) -> int:
        """Device bytes to run streamed, as the offload counts them: the ring's ``prefetch + 1``
        slots for the largest group and a run's casts (or the whole model, where that is less)."""
        return self.streamed


class _Touch:
    """A forward pre-hook: a forward is a use (for least-recently-used push-back).

    A copy of the model (``deepcopy``, ``pickle``, ``torch.save``) is in no pool: its copy of
    the hook is detached (``pool`` is ``None``) and does nothing.
    """

    def __init__(self, pool: DevicePool | None, entry: _Entry | None) -> None:
        self.pool = pool
        self.entry = entry

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.pool is not None and self.entry is not None:
            self.pool._touch(self.entry)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Touch, (None, None))


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
        for key in [k for k, h in hooks.items() if isinstance(h, _Touch) and h.pool is None]:
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

    def __init__(
        self, device: str | torch.device | None = None, *, budget: int | None = None, keep_free: int | None = None
    ) -> None:
        if device is None:
            accelerator = _accelerator()
            if accelerator is None:
                raise ValueError(f"{_WHAT}: PyTorch reports no accelerator for the default device; give device='cpu'")
            device = accelerator
        target = check_device(device, _WHAT)
        if target is None or target.type == "meta":
            raise ValueError(f"{_WHAT}: device {device!r} holds no values; give 'cpu' or the accelerator PyTorch reports")
        if target.type != "cpu" and target.index is None:
            target = torch.device(target.type, torch.accelerator.current_device_index())
        self.budget = check_bytes(budget, _WHAT, "budget")
        self.keep_free = check_bytes(keep_free, _WHAT, "keep_free")
        if self.budget is not None and self.keep_free is not None:
            raise ValueError(f"{_WHAT}: give budget= or keep_free=, not both")
        self.device = target
        self._seam = resolve_device(target, _WHAT)  # how the device counts what it holds (allocation rounding)
        self._entries: dict[int, _Entry] = {}
        self._clock = itertools.count(1)

    # ------------------------------------------------------------------ membership

    def add(
        self,
        model: nn.Module,
        *,
        name: str | None = None,
        dtype: torch.dtype | None = None,
        storage_dtype: torch.dtype | Scaled | None = None,
        groups: str | Sequence[str] = "blocks",
        skip: Callable[[nn.Module, str], bool] | None = DEFAULT_SKIP,
        prefetch: int = 1,
        pin_memory: bool | None = None,
    ) -> nn.Module:
        """Put ``model`` in the pool, on the host until :meth:`load` asks for it.

        Args:
            model: the model (changed in place when loaded; nothing is copied).
            name: its name in :meth:`stats` (default: its class name, numbered if taken).
            dtype: compute dtype, as for :func:`~torchsurgery.offload`.
            storage_dtype: storage dtype while loaded, resident or streamed, as for
                :func:`~torchsurgery.offload` (a :class:`~torchsurgery.compact.Scaled` format too).
            groups: offload groups, as for :func:`~torchsurgery.offload`.
            skip: modules that keep their dtype, as for :func:`~torchsurgery.offload`.
            prefetch: groups brought in ahead when streamed.
            pin_memory: pin streamed host storage (default: on an accelerator).

        Returns:
            ``model``.

        Raises:
            TypeError: a ``dtype`` or ``storage_dtype`` :func:`~torchsurgery.offload` refuses.
            ValueError: the model is in a pool already, the name is taken, or the budget
                is below what the model needs to run streamed.
            RuntimeError: the model is offloaded already (by torchsurgery, accelerate or
                diffusers), or the device is gone.
        """
        self._check_alive("add")
        what = f"{_WHAT}.add"
        _undo.check_module(model, what)
        check_dtype(dtype, what, "dtype")
        check_storage_format(storage_dtype, what)
        for record in _undo.records(model):
            if isinstance(record, PoolRecord) and record.pool is None:
                record.undo(model)  # a copy of a pooled model: the record it carried is stale
            elif isinstance(record, PoolRecord) and record.pool is not None:
                where = "this pool" if record.pool is self else f"the pool of {record.pool.device}"
                raise ValueError(
                    f"{_WHAT}.add: the model is already in {where} as {record.name!r}; "
                    f"a model belongs to one pool: discard it there first"
                )
        problem = already_offloaded(model)
        if problem:
            raise RuntimeError(f"{_WHAT}.add: cannot pool the model: {problem}")
        taken = {e.name for e in self._entries.values()}
        if name is None:
            base = type(model).__name__
            name = next(n for n in itertools.chain([base], (f"{base}_{i}" for i in itertools.count(2))) if n not in taken)
        elif not isinstance(name, str) or name in taken:
            raise ValueError(f"{_WHAT}.add: name {name!r} is taken or not a string; the pool holds {sorted(taken)}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"{_WHAT}.add: prefetch must be an int >= 0, got {prefetch!r}")
        options = {"dtype": dtype, "storage_dtype": storage_dtype, "groups": groups, "skip": skip,
                   "prefetch": prefetch, "pin_memory": pin_memory, "master_dtype": None, "storage": None}
        total, largest, streamed = self._footprint(model, options, None)
        entry = _Entry(model, name, options, total, largest, streamed)
        if self.budget is not None and self.budget < min(entry.total, entry.minimum):
            raise ValueError(
                f"{_WHAT}.add: budget={self.budget} bytes is below what {name!r} needs on the device: "
                f"{entry.total} bytes whole, or {entry.minimum} bytes streamed (prefetch + 1 = {prefetch + 1} "
                f"ring slots for its largest group, {largest} bytes, and a run's casts); raise the budget, or "
                "add it with groups='leaves' or prefetch=0"
            )
        entry.hook = model.register_forward_pre_hook(_Touch(self, entry))
        entry.record = PoolRecord(self, name)
        _undo.push(model, entry.record)
        key = id(model)
        # a model its owner drops leaves the pool (called before its id can be reused)
        entry.ref = weakref.ref(model, lambda _: self._entries.pop(key, None))
        self._entries[key] = entry
        return model

    def discard(self, model: nn.Module) -> nn.Module:
        """Take ``model`` out of the pool, back on the host as it was added.

        The same parameter objects in their dtypes; after a load with a ``storage_dtype``
        their values keep its rounding, as after :meth:`~torchsurgery.OffloadHandle.remove`.

        Returns:
            ``model``.
        """
        entry = self._entry(model, "discard")
        self._push_back(entry)
        entry.hook.remove()
        if entry.record is not None:
            _undo.remove(model, entry.record)
        del self._entries[id(model)]
        return model

    def close(self) -> None:
        """Discard every model (also when the device is gone: the models are on the host then)."""
        for entry in list(self._entries.values()):
            self.discard(entry.model)

    # ------------------------------------------------------------------ residency

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
        entry = self._entry(model, "load")
        keep = check_bytes(keep_free, _WHAT, "keep_free")
        if entry.handle is None:  # on the host: sized again (surgery since may have added or converted weights)
            entry.total, entry.largest, entry.streamed = self._footprint(entry.model, entry.options, entry.converted)
        room, reclaimable = self._room(entry, keep)
        handle = entry.handle
        if handle is not None:
            # room is what is free beyond the model's own bytes: plan again only for a
            # different keep_free, or when at least one more group would fit
            if entry.granted >= entry.total or (keep == entry.keep_free and room < entry.largest):
                self._touch(entry)
                return handle
            room += entry.granted
        if room + reclaimable < min(entry.total, entry.minimum):
            raise _NoRoom(
                f"{_WHAT}.load: {entry.name!r} needs {entry.total} bytes whole or {entry.minimum} streamed on "
                f"{self.device}, but only {room + reclaimable} bytes can be made free; free memory on the device, "
                "lower keep_free or raise the budget"
            )
        start = time.perf_counter()
        for other in sorted(self._loaded(entry), key=lambda e: e.last_used):
            if room >= entry.total:
                break
            room += other.granted
            self._push_back(other)
            other.pushed_back += 1
        if entry.loaded:
            self._push_back(entry)
        room = self._measured(entry, room, keep)
        if room < min(entry.total, entry.minimum):
            raise _NoRoom(
                f"{_WHAT}.load: {entry.name!r} needs {entry.total} bytes whole or {entry.minimum} streamed on "
                f"{self.device}, but with the other models pushed back only {room} bytes are free; free memory on "
                "the device or lower keep_free"
            )
        grant = entry.total if room >= entry.total else room
        handle = self._offload(entry, grant, keep)
        entry.seconds += time.perf_counter() - start
        self._touch(entry)
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
        entry = self._entry(model, "shrink")
        keep = check_bytes(keep_free, _WHAT, "keep_free")
        handle = entry.handle
        if handle is None:
            return None
        room = _free_bytes(self.device) - int(keep or 0) + entry.granted
        if room >= entry.granted:
            return handle
        start = time.perf_counter()
        self._push_back(entry)
        room = self._measured(entry, room, keep)
        if room >= min(entry.total, entry.minimum):
            handle = self._offload(entry, room, keep)
        else:
            handle = None
        entry.seconds += time.perf_counter() - start
        return handle

    def _offload(self, entry: _Entry, grant: int, keep: int | None) -> OffloadHandle:
        handle = offload_converted(entry.model, self.device, entry.converted, {**entry.options, "budget": grant})
        entry.granted = grant
        entry.keep_free = keep
        entry.loads += 1
        return handle

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
        return _free_bytes(self.device)

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
        self._push_back(self._entry(model, "unload"))
        return model

    def unload_all(self) -> None:
        """Push every model back to the host."""
        for entry in self._entries.values():
            self._push_back(entry)

    def state(self, model: nn.Module) -> str:
        """``"host"``, ``"whole"`` or ``"partial"``."""
        entry = self._entry(model, "state")
        if not entry.loaded:
            return "host"
        return "whole" if entry.granted >= entry.total else "partial"

    @property
    def models(self) -> list[nn.Module]:
        """The models of the pool, in the order they were added."""
        return [e.model for e in self._entries.values()]

    def stats(self) -> dict[str, PoolStats]:
        """Per model (by name): state, sizes, loads, push-backs, time, offload statistics."""
        return {
            e.name: PoolStats(
                name=e.name,
                state=self.state(e.model),
                total_bytes=e.total,
                largest_group_bytes=e.largest,
                device_bytes=e.granted if e.loaded else 0,
                loads=e.loads,
                pushed_back=e.pushed_back,
                seconds_loading=e.seconds,
                offload=e.handle.stats() if e.handle is not None else None,
            )
            for e in self._entries.values()
        }

    def __contains__(self, model: object) -> bool:
        return isinstance(model, nn.Module) and id(model) in self._entries

    def __repr__(self) -> str:
        limit = f"budget={self.budget}" if self.budget is not None else f"keep_free={self.keep_free}"
        return f"DevicePool({str(self.device)!r}, {limit}, models={[e.name for e in self._entries.values()]})"

    # ------------------------------------------------------------------ helpers

    def _check_alive(self, what: str) -> None:
        gone = _device_gone(self.device)
        if gone:
            raise RuntimeError(
                f"{_WHAT}.{what}: the pool's device {self.device} is gone ({gone}); its models are left as they "
                "are: call close() to take them out of the pool"
            )

    def _entry(self, model: Any, what: str) -> _Entry:
        if what != "discard":
            self._check_alive(what)
        entry = self._entries.get(id(model)) if isinstance(model, nn.Module) else None
        if entry is None:
            held = [e.name for e in self._entries.values()]
            kind = type(model).__name__
            raise ValueError(f"{_WHAT}.{what}: this {kind} is not in the pool (it holds {held}); add() it first")
        return self._refresh(entry)

    def _loaded(self, but: _Entry) -> list[_Entry]:
        return [self._refresh(e) for e in self._entries.values() if e is not but and e.loaded]

    def _refresh(self, entry: _Entry) -> _Entry:
        """Sizes and grant again after the user converted the loaded model's weights (``.to(dtype)``)."""
        handle = entry.handle
        if handle is not None and handle.converted != entry.converted:
            entry.converted = dict(handle.converted)
            o = entry.options
            entry.total, entry.largest, entry.streamed = self._footprint(entry.model, o, entry.converted)
            if all(g.resident for g in handle.plan.groups):
                entry.granted = max(entry.granted, entry.total)  # kept whole, as converted
        return entry

    def _footprint(
        self, model: nn.Module, options: dict[str, Any], converted: dict[int, torch.dtype] | None
    ) -> tuple[int, int, int]:
        """Device bytes ``model`` takes whole, its largest group's, and the least it runs in
        streamed, counted as its offload to this pool's device counts them (the plan's own
        account: allocations rounded as the device rounds them, every group through the ring)."""
        o = options
        return sizes(model, f"{_WHAT}.add", dtype=o["dtype"], storage_dtype=o["storage_dtype"], groups=o["groups"],
                     skip=o["skip"], converted=converted, device=self._seam, prefetch=int(o["prefetch"]))

    def _room(self, entry: _Entry, keep_free: int | None) -> tuple[int, int]:
        """Device bytes free for ``entry`` now, and what pushing back the others would add."""
        others = sum(e.granted for e in self._loaded(entry))
        keep = keep_free if keep_free is not None else self.keep_free
        limits = []
        if self.budget is not None:
            limits.append(self.budget - others - (entry.granted if entry.loaded else 0))
        if keep is not None or (self.budget is None and self.device.type != "cpu"):
            limits.append(_free_bytes(self.device) - (keep or 0))
        room = min(limits) if limits else 1 << 62  # a CPU pool without a limit is unlimited
        return max(0, room), others

    def _measured(self, entry: _Entry, room: int, keep: int | None) -> int:
        """``room`` for ``entry`` once models were pushed back, read again from the accelerator's
        free memory: a model holds less than the pool granted it (until its first forward, and
        where that forward's measurements keep fewer groups resident than the grant would hold),
        so counting its grant as freed would plan past ``keep``. On a CPU the count stands:
        pushing a model back there converts its weights back, it frees no memory to measure."""
        if self.device.type == "cpu":
            return room
        return min(room, self._room(entry, keep)[0])

    def _push_back(self, entry: _Entry) -> None:
        handle = self._refresh(entry).handle
        if handle is not None:
            start = time.perf_counter()
            handle.remove()
            entry.seconds += time.perf_counter() - start
        entry.granted = 0

    def _touch(self, entry: _Entry) -> None:
        entry.last_used = next(self._clock)
