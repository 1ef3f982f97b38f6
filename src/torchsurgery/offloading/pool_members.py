"""Who is in a :class:`~torchsurgery.DevicePool`: each model's place, and the order of use.

A :class:`Member` is one model's place in a pool: held weakly (a model its owner drops is
freed and leaves the pool), its sizes as its offload to the pool's device counts them, what
the pool granted it, and its counters; it loads the model (an ``offload``) and pushes it back
(that offload's undo). :class:`Members` holds a pool's members by model, hands out their
names and counts uses: a forward is a use (through :class:`Touch`, a forward pre-hook), and
pushing back starts with the least recently used.
"""

from __future__ import annotations

import itertools
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._device import AcceleratorDevice
from torchsurgery.offloading.engine import OffloadHandle, OffloadRecord, offload_converted
from torchsurgery.offloading.plan import sizes

__all__ = ["Member", "Members", "Touch", "Fallback"]


def _no_model() -> nn.Module | None:
    """The model of a copied :class:`Fallback`: none."""
    return None


class Fallback:
    """Says which finer groups a model took where its pool's room (not a budget of the user's)
    is too small for its own: to the pool's ``on_fallback(model, sentence)``, or in a warning.

    Example:
        >>> from torch import nn
        >>> model = nn.Linear(2, 2)
        >>> said = []
        >>> Fallback(lambda m, s: said.append((m is model, s)), lambda: model, "proj")("streaming single modules")
        >>> said
        [(True, 'streaming single modules')]
    """

    def __init__(self, say: Callable[[nn.Module, str], None] | None, model: Callable[[], nn.Module | None], name: str) -> None:
        self.say = say
        self.model = model  # the member's model, read weakly
        self.name = name

    def __getstate__(self) -> dict[str, Any]:
        # copied with a model whose offload a pool made (pickle, deepcopy, torch.save): the copy is
        # in no pool; it warns (the pool's on_fallback and the weak reference stay with the original)
        return {"name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.say, self.model, self.name = None, _no_model, state["name"]

    @staticmethod
    def maker(say: Callable[[nn.Module, str], None] | None) -> Callable[[Member], Fallback]:
        """What gives each member of a pool without a budget its :class:`Fallback` (telling ``say``)."""
        return lambda member: Fallback(say, member.ref, member.name)

    def __call__(self, sentence: str) -> None:
        model = self.model()
        if self.say is not None and model is not None:
            self.say(model, sentence)
        elif self.say is None:
            warnings.warn(f"torchsurgery.DevicePool.load: {self.name!r}: {sentence}", UserWarning, stacklevel=2)


class Member:
    """A model's place in a pool (see the module's docs).

    Args:
        model: the model, held weakly.
        name: its name in the pool.
        options: its :func:`~torchsurgery.offload` keywords, but the budget.
        device: the pool's device.
        what: the pool's name, for error messages.

    Example:
        >>> from torch import nn
        >>> from torchsurgery._device import AcceleratorDevice
        >>> model = nn.Linear(4, 4)
        >>> options = {"dtype": None, "storage_dtype": None, "groups": "blocks", "skip": None, "prefetch": 1,
        ...            "pin_memory": None, "master_dtype": None, "storage": None}
        >>> member = Member(model, "proj", options, AcceleratorDevice(torch.device("cpu")), "example")
        >>> member.total, member.state
        (80, 'host')
    """

    def __init__(
        self, model: nn.Module, name: str, options: dict[str, Any], device: AcceleratorDevice, what: str
    ) -> None:
        self.ref = weakref.ref(model)
        self.name = name
        self.options = options
        self.device = device
        self.what = what
        self.granted = 0  # device bytes counted against the limit while loaded
        self.keep_free: int | None = None  # what the current load was planned for
        self.last_used = 0
        self.loads = 0
        self.pushed_back = 0
        self.seconds = 0.0
        self.hook: Any = None
        self.record: _undo.Record | None = None
        # parameters (by id) the user converted with .to(dtype) while loaded, to the dtype:
        # later loads plan them in it
        self.converted: dict[int, torch.dtype] = {}
        # where the pool has no budget of its own: finer groups, down to single weights, when
        # its room is too small for the model's own (None: the budget is the user's, refused)
        self.fallback: Fallback | None = None
        # the same where the host budget is not the user's (the pool's, made from the memory available)
        # and the host cannot hold the read buffers of the groups it streams from its checkpoint
        self.host_fallback: Fallback | None = None
        self.total = self.largest = self.streamed = self.least = 0
        self.size()

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
        slots for the largest group and a run's casts (or the whole model, where that is less);
        with a :attr:`fallback`, in the finest plan it falls back to (single modules, one at a time)."""
        return self.least if self.fallback is not None else self.streamed

    @property
    def state(self) -> str:
        """``"host"``, ``"whole"`` or ``"partial"``."""
        if not self.loaded:
            return "host"
        return "whole" if self.granted >= self.total else "partial"

    def size(self) -> None:
        """Size the model again: the device bytes it takes whole, its largest group's, and the
        least it runs in streamed, counted as its offload to the pool's device counts them (the
        plan's own account: allocations rounded as the device rounds them, every group through
        the ring)."""
        o = self.options
        self.total, self.largest, self.streamed = sizes(
            self.model, f"{self.what}.add", dtype=o["dtype"], storage_dtype=o["storage_dtype"], groups=o["groups"],
            skip=o["skip"], converted=self.converted, device=self.device, prefetch=int(o["prefetch"]),
        )
        self.least = sizes(
            self.model, f"{self.what}.add", dtype=o["dtype"], storage_dtype=o["storage_dtype"], groups=o["groups"],
            skip=o["skip"], converted=self.converted, device=self.device, least=True,
        )[2]

    def refresh(self) -> Member:
        """Sizes and grant again after the user converted the loaded model's weights (``.to(dtype)``)."""
        handle = self.handle
        if handle is not None and handle.converted != self.converted:
            self.converted = dict(handle.converted)
            self.size()
            if all(g.resident for g in handle.plan.groups):
                self.granted = max(self.granted, self.total)  # kept whole, as converted
        return self

    def offload(self, grant: int, keep: int | None) -> OffloadHandle:
        """Load the model within ``grant`` device bytes, planned for ``keep`` bytes left free."""
        options = {**self.options, "budget": grant, "fallback": self.fallback, "host_fallback": self.host_fallback}
        handle = offload_converted(self.model, self.device.device, self.converted, options)
        self.granted = grant
        self.keep_free = keep
        self.loads += 1
        return handle

    def push_back(self) -> None:
        """Undo the model's offload (a no-op on the host): it is back on the host as it was added."""
        handle = self.refresh().handle
        if handle is not None:
            start = time.perf_counter()
            handle.remove()
            self.seconds += time.perf_counter() - start
        self.granted = 0


class Touch:
    """A forward pre-hook: a forward is a use (for least-recently-used push-back).

    A copy of the model (``deepcopy``, ``pickle``, ``torch.save``) is in no pool: its copy of
    the hook is detached (``members`` is ``None``) and does nothing.

    Example:
        >>> from torch import nn
        >>> hook = Touch(None, None)
        >>> hook(nn.Linear(2, 2), ()) is None
        True
    """

    def __init__(self, members: Members | None, member: Member | None) -> None:
        self.members = members
        self.member = member

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.members is not None and self.member is not None:
            self.members.touch(self.member)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Touch, (None, None))


class Members:
    """A pool's members by model, in the order they were added, and their order of use.

    Args:
        what: the pool's name, for error messages.
        fallback: where the pool has no budget (the room a load gets is not the user's): what
            gives each member its :class:`Fallback` (finer groups, down to single weights,
            where its room is too small for its own); ``None``: loads are refused.

    Example:
        >>> from torch import nn
        >>> members = Members("example")
        >>> members.name_for(nn.Linear(2, 2), None), members.names()
        ('Linear', [])
    """

    def __init__(self, what: str, fallback: Callable[[Member], Fallback] | None = None) -> None:
        self.what = what
        self.fallback = fallback
        self._by_id: dict[int, Member] = {}
        self._clock = itertools.count(1)

    def __iter__(self) -> Iterator[Member]:
        return iter(list(self._by_id.values()))

    def __contains__(self, model: object) -> bool:
        return isinstance(model, nn.Module) and id(model) in self._by_id

    def names(self) -> list[str]:
        return [m.name for m in self._by_id.values()]

    def name_for(self, model: nn.Module, name: str | None) -> str:
        """``name``, refused when taken, or (``None``) the model's class name, numbered if taken."""
        taken = set(self.names())
        if name is None:
            base = type(model).__name__
            return next(n for n in itertools.chain([base], (f"{base}_{i}" for i in itertools.count(2))) if n not in taken)
        if not isinstance(name, str) or name in taken:
            raise ValueError(f"{self.what}.add: name {name!r} is taken or not a string; the pool holds {sorted(taken)}")
        return name

    def join(self, model: nn.Module, member: Member) -> None:
        """Hold ``member`` for ``model``: its forwards count as uses; dropped by its owner, it leaves."""
        member.fallback = self.fallback(member) if self.fallback is not None else None
        member.hook = model.register_forward_pre_hook(Touch(self, member))
        key = id(model)
        # a model its owner drops leaves the pool (called before its id can be reused)
        member.ref = weakref.ref(model, lambda _: self._by_id.pop(key, None))
        self._by_id[key] = member

    def leave(self, model: nn.Module) -> Member:
        """Let go of ``model``'s member and its hook."""
        member = self._by_id.pop(id(model))
        member.hook.remove()
        return member

    def find(self, model: Any, what: str) -> Member:
        """``model``'s member, its sizes up to date.

        Raises:
            ValueError: the model is not in the pool.
        """
        member = self._by_id.get(id(model)) if isinstance(model, nn.Module) else None
        if member is None:
            kind = type(model).__name__
            raise ValueError(f"{self.what}.{what}: this {kind} is not in the pool (it holds {self.names()}); add() it first")
        return member.refresh()

    def loaded(self, but: Member) -> list[Member]:
        """The loaded members other than ``but``, least recently used first."""
        others = [m.refresh() for m in self._by_id.values() if m is not but and m.loaded]
        return sorted(others, key=lambda m: m.last_used)

    def touch(self, member: Member) -> None:
        """``member`` was used now."""
        member.last_used = next(self._clock)
