"""The undo log that every kind of surgery records into.

Each module carries its own list of :class:`Record` objects in ``module.__dict__``
under ``_LOG_KEY``; the key exists only while at least one record does, so a module
with every surgery undone has exactly the ``__dict__`` keys it started with. Keeping
the log in the module itself (rather than in a side table) is what lets ``pickle``,
``copy.deepcopy`` and ``torch.save`` carry the surgery along with the module.

Records state *what changed* (:class:`ChangeSet`), measured by diffing the module
before and after the change, rather than what the surgery intended to change: undo
is then exact even for user code (a patch's ``__patch_init__``) that we do not see.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from torchsurgery._swap import HELD_KEY, copy_of, swap_in, wrap_like

_LOG_KEY = "_torchsurgery_log"

# Global order of records, so surgery on several modules of one model can be
# listed and unwound in the order it was applied.
_sequence = itertools.count()


class _Missing:
    """Marks "no value": an attribute added (old value) or deleted (new value)."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self) -> str:
        # pickle and deepcopy keep the singleton
        return "MISSING"

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


def _same(a: Any, b: Any) -> bool:
    # identity, not ==: tensors compare elementwise and objects may define __eq__
    return a is b


@dataclass
class ChangeSet:
    """What one surgery changed in the subtree of one module, with the values to undo it.

    Attributes:
        attrs: ``__dict__`` key -> ``(old, new)``; ``old`` is :data:`MISSING` for an
            added attribute and ``new`` for a deleted one.
        entries: for dict and set attributes that stayed the same object (``_parameters``,
            ``_buffers``, ``_modules``, hook dicts, ``_non_persistent_buffers_set``...):
            attribute -> {key -> ``(old, new)``}. Set members map to ``(True/MISSING, ...)``.
        grad_flags: ``(parameter, old_requires_grad, new_requires_grad)`` for every
            parameter of the subtree whose flag changed.
        below: ``(submodule, its own ChangeSet)`` for every submodule (found before the
            surgery) whose attributes, parameters, buffers, hooks or class changed.
        classes: ``(old_class, new_class)`` of the module's own class when it changed
            (only submodules' change sets carry one: a patch never changes its own).
        values: ``(tensor, copy)``: a parameter or buffer of the subtree whose memory was
            written in place, and a copy of what it held before the first write. Undo writes
            the copy through the tensor object, so it lands even where later surgery gave
            the tensor new memory (a conversion undone since), cast to its dtype.
        storage: ``(tensor, alias, class)``: a tensor of the subtree whose ``.data`` was
            replaced, or that was swapped (``torch.utils.swap_tensors``, e.g. into a tensor
            subclass), an alias of the storage it had and its class then.
        tensor_hooks: ``(tensor, attribute, key, old, new)`` for hooks registered on or
            removed from the subtree's parameters and buffers themselves.
    """

    attrs: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    entries: dict[str, dict[Any, tuple[Any, Any]]] = field(default_factory=dict)
    grad_flags: list[tuple[nn.Parameter, bool, bool]] = field(default_factory=list)
    below: list[tuple[nn.Module, ChangeSet]] = field(default_factory=list)
    classes: tuple[type, type] | None = None
    values: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    storage: list[tuple[torch.Tensor, torch.Tensor, type]] = field(default_factory=list)
    tensor_hooks: list[tuple[torch.Tensor, str, Any, Any, Any]] = field(default_factory=list)

    def keys(self) -> set[tuple[str, Any]]:
        """Every place this change set touched, as comparable keys."""
        touched: set[tuple[str, Any]] = {("attr", k) for k in self.attrs}
        for name, changes in self.entries.items():
            touched.update(("entry", (name, k)) for k in changes)
        touched.update(("grad", id(p)) for p, _, _ in self.grad_flags)
        for child, own in self.below:
            touched.update(("below", (id(child), key)) for key in own.keys())
            if own.classes is not None:
                touched.add(("class", id(child)))
        touched.update(("value", id(t)) for t, _ in self.values)
        touched.update(("value", id(t)) for t, _, _ in self.storage)
        touched.update(("tensor_hook", (id(t), a, k)) for t, a, k, _, _ in self.tensor_hooks)
        return touched

    def revert(self, module: nn.Module) -> None:
        """Put back every old value. Never raises for a consistent module."""
        d = module.__dict__
        for name, changes in self.entries.items():
            container = d.get(name)
            if container is None:
                continue
            for key, (old, _new) in changes.items():
                if isinstance(container, set):
                    if old is MISSING:
                        container.discard(key)
                    else:
                        container.add(key)
                elif old is MISSING:
                    container.pop(key, None)
                else:
                    container[key] = old
        for key, (old, _new) in self.attrs.items():
            if old is MISSING:
                d.pop(key, None)
            else:
                d[key] = old
        for child, own in self.below:
            own.revert(child)
            if own.classes is not None:
                child.__class__ = own.classes[0]
        for param, old_flag, _ in self.grad_flags:
            param.requires_grad_(old_flag)
        for tensor, alias, kind in self.storage:
            # (a wrapper subclass's `.data =` writes values into what it stores: swapped back instead)
            if type(tensor) is kind and torch._has_compatible_shallow_copy_type(tensor, alias) and not is_traceable_wrapper_subclass(tensor):
                tensor.data = alias
            else:  # swapped into another class, or across backends `.data =` refuses: swapped back, the object kept
                # the graph of a live output may hold the tensor (as ``.data =`` lets it): the undo goes through
                swap_in(tensor, wrap_like(tensor, alias, kind), pending_backward_ok=True)
        with torch.no_grad():
            for tensor, copy in self.values:
                tensor.detach().copy_(copy)
        for tensor, attr, key, old, _ in self.tensor_hooks:
            hooks = getattr(tensor, attr, None)
            if hooks is None:
                continue
            if old is MISSING:
                hooks.pop(key, None)
            else:
                hooks[key] = old


_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _storage_key(tensor: torch.Tensor) -> int | None:
    """The address of the memory ``tensor`` views, where it has values to keep.

    A wrapper tensor subclass (an offloaded weight, a quantised one) has no memory of its
    own: its first inner tensor's counts.
    """
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return None
    if is_traceable_wrapper_subclass(tensor):
        inner = getattr(tensor, tensor.__tensor_flatten__()[0][0])
        return _storage_key(inner)
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):  # a subclass without memory
        return None



def _layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What ``tensor.data = other`` changes (its memory, shape and placement)."""
    if tensor.layout is not torch.strided:
        return (type(tensor), tensor.layout, tensor.shape, tensor.dtype, tensor.device)
    return (
        type(tensor), _storage_key(tensor), tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.device
    )


@dataclass
class _ModuleState:
    cls: type
    attrs: dict[str, Any]
    containers: dict[str, dict[Any, Any] | set[Any]]


@dataclass
class Snapshot:
    """A shallow picture of a module's subtree, diffed later into a :class:`ChangeSet`.

    Nothing is copied but containers: tensors are kept as aliases, and the values of one
    are copied only when a :func:`tracking_writes` block is about to write to its memory
    (``by_storage``: memory address -> the parameters and buffers on that memory).
    """

    modules: list[tuple[nn.Module, _ModuleState]]
    grad_flags: list[tuple[nn.Parameter, bool]]
    tensors: list[tuple[torch.Tensor, torch.Tensor, tuple[Any, ...], dict[str, dict[Any, Any] | None]]]
    by_storage: dict[int, list[torch.Tensor]]
    written: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


def _module_state(module: nn.Module) -> _ModuleState:
    attrs = {k: v for k, v in module.__dict__.items() if k != _LOG_KEY}
    containers: dict[str, dict[Any, Any] | set[Any]] = {}
    for key, value in attrs.items():
        if isinstance(value, dict):
            containers[key] = dict(value)
        elif isinstance(value, set):
            containers[key] = set(value)
    return _ModuleState(type(module), attrs, containers)


def snapshot(module: nn.Module) -> Snapshot:
    """Take a shallow picture of ``module`` and every module, parameter and buffer below it."""
    modules = [(m, _module_state(m)) for m in module.modules()]
    tensors = []
    by_storage: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    flags: list[tuple[nn.Parameter, bool]] = []
    for m, _ in modules:
        for is_param, t in [*((True, p) for p in m._parameters.values()), *((False, b) for b in m._buffers.values())]:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            if is_param:
                flags.append((t, t.requires_grad))  # type: ignore[arg-type]
            alias = t.detach()
            hooks = {a: (dict(h) if isinstance(h := getattr(t, a, None), dict) else None) for a in _TENSOR_HOOKS}
            tensors.append((t, alias, _layout(t), hooks))
            key = _storage_key(t)
            if key is not None:
                by_storage.setdefault(key, []).append(t)
    return Snapshot(modules, flags, tensors, by_storage)


class _WriteTracker(TorchDispatchMode):
    """Copies a snapshotted tensor's values just before the first in-place write to them."""

    def __init__(self, state: Snapshot) -> None:
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
                for tensor in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(tensor, torch.Tensor):
                        self._keep(tensor)
        return func(*args, **kwargs)

    def _keep(self, tensor: torch.Tensor) -> None:
        key = _storage_key(tensor)
        if key is None or key in self.state.written or key not in self.state.by_storage:
            return
        self.state.written[key] = [(t, copy_of(t)) for t in self.state.by_storage[key]]


@contextlib.contextmanager
def tracking_writes(state: Snapshot) -> Iterator[None]:
    """Within the block, tensors of ``state`` written in place have their values kept first."""
    with _WriteTracker(state):
        yield


def _diff_module(before: _ModuleState, module: nn.Module) -> ChangeSet:
    now = {k: v for k, v in module.__dict__.items() if k != _LOG_KEY}
    changes = ChangeSet()
    for key in before.attrs.keys() | now.keys():
        old, new = before.attrs.get(key, MISSING), now.get(key, MISSING)
        if not _same(old, new):
            changes.attrs[key] = (old, new)
            continue
        if key not in before.containers:
            continue
        was, cur = before.containers[key], new
        entry_changes: dict[Any, tuple[Any, Any]] = {}
        if isinstance(was, set):
            for member in was ^ cur:
                entry_changes[member] = (
                    True if member in was else MISSING,
                    True if member in cur else MISSING,
                )
        else:
            for k in was.keys() | cur.keys():
                o, n = was.get(k, MISSING), cur.get(k, MISSING)
                if not _same(o, n):
                    entry_changes[k] = (o, n)
        if entry_changes:
            changes.entries[key] = entry_changes
    if type(module) is not before.cls:
        changes.classes = (before.cls, type(module))
    return changes


def diff(before: Snapshot, module: nn.Module) -> ChangeSet:
    """Everything that changed in ``module``'s subtree since ``before`` was taken.

    The module's own class is not compared (a patch changes it on purpose); the
    classes of the modules below it are.
    """
    (_, own), *rest = before.modules
    changes = _diff_module(own, module)
    changes.classes = None
    for child, state in rest:
        below = _diff_module(state, child)
        if below.attrs or below.entries or below.classes is not None:
            changes.below.append((child, below))
    for param, flag in before.grad_flags:
        if param.requires_grad != flag:
            changes.grad_flags.append((param, flag, param.requires_grad))
    for pairs in before.written.values():
        changes.values.extend(pairs)
    for tensor, alias, layout, hooks in before.tensors:
        if _layout(tensor) != layout:
            changes.storage.append((tensor, alias, layout[0]))
        for attr, was in hooks.items():
            cur = getattr(tensor, attr, None)
            was, cur = was or {}, cur if isinstance(cur, dict) else {}
            for k in was.keys() | cur.keys():
                o, n = was.get(k, MISSING), cur.get(k, MISSING)
                if not _same(o, n):
                    changes.tensor_hooks.append((tensor, attr, k, o, n))
    return changes


class Record:
    """One surgery applied to one module. Subclasses add what their undo needs.

    Attributes:
        seq: position in the global order of surgery (later records have larger values).
    """

    kind: str = "surgery"
    internal: bool = False  # part of a larger surgery (listed and undone through it)

    def __init__(self) -> None:
        self.seq = next(_sequence)

    def describe(self) -> str:
        """One line for listings such as ``torchsurgery inspect``."""
        return self.kind

    def undo(self, module: nn.Module) -> None:
        """Undo this surgery on ``module`` (the module the record was pushed on).

        Subclasses override this; it must remove the record from the log (via the
        pillar's own undo function, which calls :func:`remove`) and raise, changing
        nothing, when the surgery cannot be undone yet.
        """
        raise TypeError(f"torchsurgery: {self.describe()} cannot be undone by torchsurgery.restore")


class Hold:
    """Tensors another surgery depends on by identity (an offload streams them).

    While held, a patch may not replace or remove them (:func:`holder_of`). Made by
    :func:`hold`, ended by :func:`release`. The mark is on the tensor objects themselves
    (an attribute), not in a table keyed by ``id()``: a copy of a model (``deepcopy``,
    ``pickle``, ``torch.save``) carries its own marks along with its copied surgery.

    Attributes:
        what: what depends on the tensors, for messages (``"an active offload"``).
    """

    def __init__(self, what: str, tensors: tuple[torch.Tensor, ...]) -> None:
        self.what = what
        self.tensors = tensors


def hold(tensors: list[torch.Tensor], what: str) -> Hold:
    """Mark ``tensors`` as depended on by ``what`` until :func:`release`."""
    held = Hold(what, tuple({id(t): t for t in tensors}.values()))
    for t in held.tensors:
        t.__dict__[HELD_KEY] = what
    return held


def release(held: Hold) -> None:
    """End ``held`` (a no-op the second time)."""
    for t in held.tensors:
        if t.__dict__.get(HELD_KEY) == held.what:
            del t.__dict__[HELD_KEY]


def _holder(tensor: Any) -> str | None:
    return tensor.__dict__.get(HELD_KEY) if isinstance(tensor, torch.Tensor) else None


def holder_of_any(tensors: Iterable[torch.Tensor]) -> str | None:
    """What depends on one of ``tensors`` by identity, if anything (``"an active offload"``)."""
    return next((h for h in map(_holder, tensors) if h is not None), None)


def holder_of(changes: ChangeSet) -> str | None:
    """What depends on a parameter or buffer that ``changes`` replaced or removed, if anything."""
    for name in ("_parameters", "_buffers"):
        for old, new in changes.entries.get(name, {}).values():
            holder = _holder(old) or _holder(new)
            if holder:
                return holder
    for tensor, _, _ in changes.storage:
        if _holder(tensor):
            return _holder(tensor)
    for _, below in changes.below:
        holder = holder_of(below)
        if holder:
            return holder
    return None


_SETTLE_S = 2.0  # how long surgery holding a forward lock lets threads inside the model reach it
_waiting: dict[int, object] = {}  # thread ident -> the lock of the surgery's own it waits for
_tolerated = threading.local()  # .lock: the lock whose waiters this thread's surgery goes ahead past


@contextlib.contextmanager
def waiting_on(lock: object) -> Iterator[None]:
    """Within the block the calling thread only waits for ``lock`` (an offload's forward lock).

    Surgery done under :func:`waiters_ok` of the same lock does not count it as running a
    forward: once it holds the lock, the waiting thread must check that what it locked is
    still there.
    """
    me = threading.get_ident()
    _waiting[me] = lock
    try:
        yield
    finally:
        _waiting.pop(me, None)


@contextlib.contextmanager
def waiters_ok(lock: object) -> Iterator[None]:
    """Within the block, :func:`check_idle` of this thread passes threads that only wait for ``lock``."""
    previous = getattr(_tolerated, "lock", None)
    _tolerated.lock = lock
    try:
        yield
    finally:
        _tolerated.lock = previous


def running_elsewhere(module: nn.Module) -> str | None:
    """The module of ``module``'s subtree another thread is running now (its name, and the thread's), if any.

    Read from the threads' stacks: a module is running while a frame of
    ``nn.Module._call_impl`` with it as ``self`` is on a stack (unless the thread only waits
    for the lock this thread's surgery holds: see :func:`waiting_on`).
    """
    tolerated = getattr(_tolerated, "lock", None)
    waiters = {ident for ident, lock in _waiting.copy().items() if tolerated is not None and lock is tolerated}
    me = threading.get_ident()
    call = nn.Module._call_impl.__code__
    running: list[tuple[int, Any]] = []
    frames, frame = sys._current_frames(), None
    try:
        for ident, frame in frames.items():
            while frame is not None and ident != me and ident not in waiters:
                if frame.f_code is call:
                    running.append((ident, frame.f_locals.get("self")))
                frame = frame.f_back
    finally:
        # frame objects held here would keep the callers' frames (and their locals) in a
        # reference cycle until the garbage collector runs
        del frames, frame
    if not running:
        return None
    names = {id(m): name for name, m in module.named_modules()}
    threads = {t.ident: t.name for t in threading.enumerate()}
    for ident, owner in running:
        if id(owner) in names and any(m is owner for m in module.modules()):
            return f"{names[id(owner)] or '<root>'} ({type(owner).__name__}, in thread {threads.get(ident, ident)!r})"
    return None


def check_idle(module: nn.Module, what: str) -> None:
    """Refuse surgery that changes classes or hooks of ``module``'s subtree while another thread runs it.

    A forward that is running would find its class or hooks changed under it (``super()``
    in a patched ``forward`` fails once the patch is gone; hook dicts change size while
    iterated).

    Raises:
        RuntimeError: another thread is inside the forward of a module of the subtree.
    """
    busy = running_elsewhere(module)
    if busy is not None and getattr(_tolerated, "lock", None) is not None:
        # this thread holds the lock forwards take: a thread inside the model is on its way to
        # wait for it (between its call and the lock), or runs a part that takes none: let it
        # get there, or finish
        deadline = time.monotonic() + _SETTLE_S
        while busy is not None and time.monotonic() < deadline:
            time.sleep(0.001)
            busy = running_elsewhere(module)
    if busy is not None:
        raise RuntimeError(
            f"{what}: {busy} is running a forward now; changing its class or hooks under it would break that "
            "forward. Call this again once it returned (join the thread, or hold your own lock around forwards "
            "and surgery)"
        )


def records(module: nn.Module) -> list[Record]:
    """The records on ``module``, oldest first (a copy: mutate with push/remove)."""
    return list(module.__dict__.get(_LOG_KEY, ()))


def push(module: nn.Module, record: Record) -> None:
    """Append ``record`` to ``module``'s log."""
    module.__dict__.setdefault(_LOG_KEY, []).append(record)


def remove(module: nn.Module, record: Record) -> None:
    """Drop ``record`` from ``module``'s log; the log key goes when it is empty."""
    log = module.__dict__.get(_LOG_KEY, [])
    log[:] = [r for r in log if r is not record]
    if not log:
        module.__dict__.pop(_LOG_KEY, None)



def with_own_log(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a copy of a module's ``__dict__``, as pickled) given a log of its own.

    A module rebuilt from it (a shallow copy) records and unwinds surgery in that log,
    leaving the original module's log alone. ``state`` is changed in place and returned.
    """
    if _LOG_KEY in state:
        state[_LOG_KEY] = list(state[_LOG_KEY])
    return state

@contextlib.contextmanager
def all_or_nothing(model: nn.Module) -> Iterator[None]:
    """Within the block, surgery on ``model``'s subtree is done whole, or undone exactly.

    For surgery made of several steps on several modules (``DynamicSwapInstaller.install_model``
    replacing an installation module by module): when the block raises, every module gets
    back its class, attributes, parameters and buffers (the same objects, holding what they
    held: swaps are swapped back) and its undo log (the same records, in order), whatever
    the steps did. Writes in place are not tracked: the block must not make any.
    """
    state = snapshot(model)
    cls = type(model)
    logs = [(m, list(m.__dict__.get(_LOG_KEY, ()))) for m in model.modules()]
    try:
        yield
    except BaseException:
        diff(state, model).revert(model)
        model.__class__ = cls
        for module, log in logs:
            if log:
                module.__dict__[_LOG_KEY] = log
            else:
                module.__dict__.pop(_LOG_KEY, None)
        raise


def rebase_saved(model: nn.Module, after: Record, given_back: list[torch.Tensor]) -> None:
    """Surgery applied on top of ``after`` that saved what a tensor of ``given_back`` held
    gives back what it holds now: ``after`` was undone first, out of order.

    A later record saved the tensor as ``after`` had left it (a buffer on the device, say);
    undone now, it must give the tensor back as it is without ``after`` (the buffer back on
    the host), not bring ``after``'s state back. Only saved states of the class the tensor
    has now are rebased.
    """
    now = {id(t): t for t in given_back}
    for _, _, record in walk(model):
        changes = getattr(record, "changes", None)
        if record.seq > after.seq and isinstance(changes, ChangeSet):
            _rebase(changes, now)


def _rebase(changes: ChangeSet, now: dict[int, torch.Tensor]) -> None:
    changes.storage = [
        (t, t.detach(), kind) if id(t) in now and type(t) is kind else (t, alias, kind)
        for t, alias, kind in changes.storage
    ]
    for _, below in changes.below:
        _rebase(below, now)


def walk(model: nn.Module) -> Iterator[tuple[str, nn.Module, Record]]:
    """Every record in ``model``'s tree as ``(qualified name, module, record)``, in applied order."""
    found = [
        (name, module, record)
        for name, module in model.named_modules(remove_duplicate=True)
        for record in records(module)
    ]
    found.sort(key=lambda item: item[2].seq)
    yield from found


@dataclass(frozen=True)
class SurgeryEntry:
    """One line of :func:`surgery_log`.

    Attributes:
        module_name: qualified name of the module the surgery sits on (``""`` for the root).
        kind: the pillar's word for it (``"patch"``, ``"offload"``, ``"flex"``...).
        description: a readable one-line description.
        seq: position in the global order of surgery.

    Example:
        >>> from torch import nn
        >>> import torchsurgery
        >>> class Tag(torchsurgery.Patch, nn.Module): pass
        >>> entry, = torchsurgery.surgery_log(torchsurgery.patch(nn.ReLU(), Tag))
        >>> entry.module_name, entry.description
        ('', 'patch Tag')
    """

    module_name: str
    kind: str
    description: str
    seq: int


def surgery_log(model: nn.Module) -> list[SurgeryEntry]:
    """Every surgery applied to ``model`` and its submodules, oldest first.

    Args:
        model: the root module.

    Returns:
        One :class:`SurgeryEntry` per applied surgery, in the order it was applied.

    Example:
        >>> from torch import nn
        >>> import torchsurgery
        >>> class Tag(torchsurgery.Patch, nn.Module): pass
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> _ = torchsurgery.patch(model[0], Tag)
        >>> [(e.module_name, e.kind) for e in torchsurgery.surgery_log(model)]
        [('0', 'patch')]
    """
    check_module(model, "torchsurgery.surgery_log")
    return [
        SurgeryEntry(name, record.kind, record.describe(), record.seq)
        for name, _, record in walk(model)
        if not record.internal
    ]


def restore(model: nn.Module) -> nn.Module:
    """Undo every surgery on ``model`` and its submodules, newest first.

    Each step is all-or-nothing. If one cannot be undone (for instance another tool
    changed a module's class on top of a patch), it raises naming that surgery, and
    the surgery older than it stays in place, still listed by :func:`surgery_log`.

    Args:
        model: the root module.

    Returns:
        ``model`` itself.

    Raises:
        RuntimeError: a surgery could not be undone; the message says which and why.

    Example:
        >>> from torch import nn
        >>> import torchsurgery
        >>> class Tag(torchsurgery.Patch, nn.Module): pass
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> _ = torchsurgery.patch(model[0], Tag), torchsurgery.patch(model[1], Tag)
        >>> torchsurgery.surgery_log(torchsurgery.restore(model))
        []
    """
    check_module(model, "torchsurgery.restore")
    check_not_compiling("restore")
    for name, module, record in reversed(list(walk(model))):
        if record not in records(module):
            continue  # undone already as part of a larger surgery (e.g. a wrapper's hooks)
        try:
            record.undo(module)
        except Exception as exc:
            raise RuntimeError(
                f"torchsurgery.restore: could not undo {record.describe()} on "
                f"{name or '<root>'}: {exc}"
            ) from exc
    return model


def check_module(obj: object, what: str) -> None:
    """Refuse anything that is not an ``nn.Module``, naming the function."""
    if not isinstance(obj, nn.Module):
        raise TypeError(f"{what}: expected an nn.Module, got {type(obj).__name__}")


def check_not_compiling(what: str) -> None:
    """Surgery changes classes and attributes that a compiled graph has guarded on."""
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"torchsurgery.{what} was called inside a torch.compile'd region; "
            "do surgery outside the compiled function and compile afterwards"
        )
