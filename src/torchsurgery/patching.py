"""Live, reversible class patching of ``nn.Module`` instances.

A *patch* is a subclass of :class:`Patch` and of the module class it applies to::

    class MostlyFrozenEmbedding(torchsurgery.Patch, nn.Embedding):
        def __patch_init__(self, trainable_token_ids): ...   # runs on the existing instance
        def forward(self, input): ...

Patching gives the existing instance a subclass as its class. Nothing is copied:
the object, its parameters and buffers keep their ``id`` and ``data_ptr``, and
``isinstance(module, nn.Embedding)`` still holds. What ``__patch_init__`` changes is
measured by diffing the module before and after it runs and recorded in the module's
undo log, so :func:`unpatch` restores exactly the module it was given, even for a
patch removed from the middle of a stack.

The class given to an instance is a pure function of (patch, class before the patch):
one class per pair, built once and cached. So N patched layers of one type share one
class (``torch.compile`` compiles their forward once), and a patched module pickles by
naming its original class and its patches, which rebuild the same class.

The class swap is invisible to code that looks a class up by name: the built class
carries the original's ``__name__``, ``__qualname__`` and ``__module__`` (so ``str(cls)``
and ``type(module).__name__`` are those of the original; transformers keys its
``output_hidden_states`` recording on ``str(model.__class__)`` and writes the class name
into a saved config). ``isinstance`` sees the patch; :func:`patches` lists it.

A patch belongs to the instance it was applied to. Where torch or a library builds a
*new* instance from a patched module's class (slicing an ``nn.Sequential`` or
``nn.ModuleList`` calls ``type(self)(...)``), the new object is an unpatched instance of
the original class; its children are the same (possibly patched) modules. Copies of the
instance itself (``copy.copy``, ``copy.deepcopy``, ``pickle``, ``torch.save``) keep their
patches and can be unpatched on their own.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, TypeVar

from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchsurgery import _undo
from torchsurgery._names import ModuleFilter, select

__all__ = [
    "Patch",
    "patch",
    "unpatch",
    "is_patched",
    "patches",
    "original_class",
    "patched",
]

P = TypeVar("P", bound="Patch")
M = TypeVar("M", bound=nn.Module)


class PatchRecord(_undo.Record):
    """The undo-log entry of one applied patch.

    Attributes:
        patch: the patch class.
        original: the module's class before its *first* patch (the classes in between
            are derived from it and the stack, so nothing unpicklable is stored).
        changes: what ``__patch_init__`` changed.
    """

    kind = "patch"

    def __init__(self, patch: type[Patch], original: type[nn.Module], changes: _undo.ChangeSet):
        super().__init__()
        self.patch = patch
        self.original = original
        self.changes = changes

    def describe(self) -> str:
        return f"patch {self.patch.__qualname__}"

    def undo(self, module: nn.Module) -> None:
        unpatch(module, self.patch)


class Patch(nn.Module):
    """Base class of patches: subclass it together with the module class to patch.

    A patch is never constructed; it is applied to an existing instance with
    :meth:`from_existing` or :func:`patch`, which runs :meth:`__patch_init__` on it.
    Calling the class of a patched module (``type(module)(...)``, as slicing a patched
    ``nn.Sequential`` does) builds an unpatched instance of the original class. A patch
    must not define ``__init__``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> class Doubled(torchsurgery.Patch, nn.Linear):
        ...     def __patch_init__(self, factor: float = 2.0) -> None:
        ...         self.factor = factor
        ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
        ...         return super().forward(x) * self.factor
        >>> layer = nn.Linear(3, 3)
        >>> same = Doubled.from_existing(layer, factor=3.0)
        >>> same is layer, isinstance(layer, nn.Linear), torchsurgery.is_patched(layer)
        (True, True, True)
        >>> type(torchsurgery.unpatch(layer)) is nn.Linear, hasattr(layer, "factor")
        (True, False)
    """

    __patch_needs_plain_weights__: ClassVar[bool] = False
    """Set to True by a patch whose ``forward`` reads its weights' memory directly (``data_ptr``,
    a custom C++ or Triton kernel), so that it cannot work with weights that are tensor
    subclasses without memory of their own: an :func:`~torchsurgery.offload` that keeps the
    module's weights in another dtype (as :class:`~torchsurgery.OffloadedTensor`) refuses the
    module, and :func:`patch` refuses the patch on a module whose weights already are."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original: type[nn.Module] | None = type(self).__dict__.get("__patch_original__")
        if original is not None:
            # type(module)(...) on a patched module, as slicing an nn.Sequential does:
            # a new, unpatched instance of the original class
            self.__class__ = original  # type: ignore[assignment]
            original.__init__(self, *args, **kwargs)
            return
        raise TypeError(
            f"{type(self).__qualname__} is a patch and is not constructed directly; "
            f"build the module as usual and apply the patch with "
            f"{type(self).__qualname__}.from_existing(module, ...) or torchsurgery.patch(...)"
        )

    def __patch_init__(self, *args: Any, **kwargs: Any) -> None:
        """Set up the patch on the existing instance (add parameters, freeze weights...).

        Runs with ``self`` already of the patched class. Whatever it changes on ``self``
        or on any module below it (attributes, parameters, buffers, submodules, module
        hooks, hooks on the parameters themselves, ``requires_grad`` flags, values written
        in place, storage replaced through ``.data``) is undone by :func:`unpatch`; values
        are copied just before their first in-place write, so only what it writes costs
        memory. If it raises, the module is left exactly as it was and the exception
        propagates. What a patch could not undo is refused the same way, with a
        ``RuntimeError``: changing ``__class__`` (of ``self`` or of a module below) and
        applying other surgery (another patch, an offload) below ``self``.
        """

    @classmethod
    def from_existing(cls: type[P], module: nn.Module, /, *args: Any, **kwargs: Any) -> P:
        """Patch ``module`` in place with this class and return it, typed as the patch.

        Args:
            module: the instance to patch; it must be an instance of the classes the
                patch is declared for.
            *args: passed to :meth:`__patch_init__`.
            **kwargs: passed to :meth:`__patch_init__`.

        Returns:
            ``module`` itself.
        """
        patch(module, cls, *args, **kwargs)
        return module  # type: ignore[return-value]

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # The class may be built at run time, so pickle names how to rebuild it
        # instead of the class itself; the state (with the undo log) goes as usual.
        stack = tuple(patches(self))
        # a shallow copy gets its own log, so unpatching it leaves this module's log alone
        state = _undo.with_own_log(dict(self.__getstate__()))
        return (_rebuild, (original_class(self), stack), state)


def _rebuild(original: type[nn.Module], stack: tuple[type[Patch], ...]) -> nn.Module:
    cls = _chain(original, stack)
    module: nn.Module = cls.__new__(cls)
    return module


_CLASS_CACHE: dict[tuple[type[Patch], type[nn.Module]], type[nn.Module]] = {}


def _compose(patch_cls: type[Patch], base: type[nn.Module]) -> type[nn.Module]:
    """The class of an instance of ``base`` patched with ``patch_cls`` (cached per pair)."""
    key = (patch_cls, base)
    cls = _CLASS_CACHE.get(key)
    if cls is None:
        label, original = _label_and_original(base)
        # named as the original, so that lookups by name or str(cls) find the original
        namespace: dict[str, Any] = {
            "__module__": original.__module__,
            "__qualname__": original.__qualname__,
            "__patch_original__": original,
            "__patch_label__": f"{patch_cls.__qualname__}[{label}]",
        }
        forward = _passing_on(patch_cls)
        if forward is not None:
            namespace["forward"] = _with_signature_of(forward, base.forward)
        cls = type(original.__name__, (patch_cls, base), namespace)
        _CLASS_CACHE[key] = cls
    return cls


def _passing_on(patch_cls: type[Patch]) -> types.FunctionType | None:
    """The patch's ``forward`` if it takes only ``(self, *args, **kwargs)`` (it passes them on)."""
    forward = next((c.__dict__["forward"] for c in patch_cls.__mro__ if issubclass(c, Patch) and "forward" in c.__dict__), None)
    if not isinstance(forward, types.FunctionType):
        return None
    kinds = [p.kind for p in inspect.signature(forward, follow_wrapped=False).parameters.values()]
    return forward if kinds == [_POSITIONAL, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD] else None


_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD


def _with_signature_of(forward: types.FunctionType, wrapped: Any) -> types.FunctionType:
    """A copy of ``forward`` that shows ``wrapped``'s signature.

    Programs read ``inspect.signature(model.forward)`` to decide what to pass (transformers'
    ``generate()`` passes ``logits_to_keep`` only where ``forward`` names it), so a patch that
    passes everything on must show the signature of what it passes to. The copy shares the
    code object, so the compiler's cache for it is shared too; its ``super()`` is the patch's.
    """
    copy = types.FunctionType(forward.__code__, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__)
    copy.__kwdefaults__ = forward.__kwdefaults__
    copy.__qualname__ = forward.__qualname__
    copy.__dict__.update(forward.__dict__)
    copy.__doc__ = getattr(wrapped, "__doc__", None) or forward.__doc__
    copy.__wrapped__ = wrapped  # type: ignore[attr-defined]
    copy.__signature__ = inspect.signature(wrapped)  # type: ignore[attr-defined]
    return copy


def _label_and_original(cls: type) -> tuple[str, type[nn.Module]]:
    """A class's name for messages (``Clamped[Scaled[Linear]]``) and the class it patches."""
    d = cls.__dict__
    if "__patch_original__" in d:
        return d["__patch_label__"], d["__patch_original__"]
    return cls.__qualname__, cls


def _chain(original: type[nn.Module], stack: tuple[type[Patch], ...] | list[type[Patch]]) -> type[nn.Module]:
    cls = original
    for patch_cls in stack:
        cls = _compose(patch_cls, cls)
    return cls


def _targets(patch_cls: type[Patch]) -> list[type]:
    """The module classes a patch is declared for (its non-patch bases)."""
    return [
        c
        for c in patch_cls.__mro__
        if issubclass(c, nn.Module) and not issubclass(c, Patch) and c is not nn.Module
    ]


def _patch_records(module: nn.Module) -> list[PatchRecord]:
    return [r for r in _undo.records(module) if isinstance(r, PatchRecord)]


def _check_patch_class(patch_cls: Any, what: str) -> None:
    if not (isinstance(patch_cls, type) and issubclass(patch_cls, Patch)) or patch_cls is Patch:
        raise TypeError(
            f"torchsurgery.{what}: expected a subclass of torchsurgery.Patch "
            f"(class MyPatch(torchsurgery.Patch, nn.Linear): ...), got {patch_cls!r}"
        )


def _check_class_intact(module: nn.Module, records: list[PatchRecord], what: str) -> None:
    """Refuse to work on a module whose class was swapped by someone else after patching."""
    if not records:
        return
    expected = _chain(records[0].original, [r.patch for r in records])
    if type(module) is not expected:
        raise RuntimeError(
            f"torchsurgery.{what}: the module's class is {_label_and_original(type(module))[0]}, not "
            f"the {_label_and_original(expected)[0]} its patches gave it; another tool changed its class "
            f"after patching (e.g. torch.nn.utils.parametrize). Undo that change first."
        )


def _outside_the_change_set(
    module: nn.Module, new_cls: type[nn.Module], state: _undo.Snapshot,
    logs: list[tuple[nn.Module, list[_undo.Record]]],
) -> str | None:
    """What ``__patch_init__`` did that its patch could not undo, if anything."""
    if type(module) is not new_cls:
        return (
            f"changed the module's class to {type(module).__qualname__}; a patch never changes "
            "__class__ itself (its class is the patch), so override methods in the patch instead"
        )
    for child, log in logs:
        added = [r for r in _undo.records(child) if r not in log]
        if added:
            return (
                f"applied {added[0].describe()} to a module below it; surgery inside __patch_init__ "
                "cannot be undone with the patch, so apply it separately, before or after"
            )
    for child, was in state.modules[1:]:
        if type(child) is not was.cls:
            names = {id(m): name for name, m in module.named_modules()}
            return (
                f"changed the class of {names.get(id(child), 'a submodule')!r} from {was.cls.__qualname__} "
                f"to {type(child).__qualname__}; patch that module with its own patch instead"
            )
    return None


def _put_back(
    module: nn.Module, before: type[nn.Module], state: _undo.Snapshot,
    logs: list[tuple[nn.Module, list[_undo.Record]]],
) -> None:
    """Undo a failed or refused ``__patch_init__``: surgery it did below, its changes, the class."""
    for child, log in reversed(logs):
        for record in reversed(_undo.records(child)):
            if record not in log:
                try:
                    record.undo(child)
                except Exception:  # e.g. a patch of the module itself: the diff below puts all back
                    _undo.remove(child, record)
    _undo.diff(state, module).revert(module)
    module.__class__ = before


def _check_plain_weights(module: nn.Module, patch_cls: type[Patch]) -> None:
    """Refuse a patch that reads weight memory directly on a module whose weights have none."""
    if not patch_cls.__patch_needs_plain_weights__:
        return
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if is_traceable_wrapper_subclass(t):
            raise TypeError(
                f"torchsurgery.patch: {patch_cls.__qualname__} reads weight memory directly "
                f"(__patch_needs_plain_weights__), but {name!r} is a {type(t).__name__} without memory of its "
                "own (e.g. a weight an offload keeps in another dtype); patch before offloading, or remove the "
                "offload (handle.remove()) first"
            )


def patch(module: M, patch_cls: type[Patch], /, *args: Any, **kwargs: Any) -> M:
    """Apply ``patch_cls`` to ``module`` in place and return ``module``.

    Args:
        module: the instance to patch.
        patch_cls: a subclass of :class:`Patch` declared for ``module``'s class or a base of it.
        *args: passed to ``patch_cls.__patch_init__``.
        **kwargs: passed to ``patch_cls.__patch_init__``.

    Returns:
        ``module`` itself, now an instance of a subclass of ``patch_cls``.

    Raises:
        TypeError: ``module`` is not a module, ``patch_cls`` is not a patch, or the
            patch is declared for a class ``module`` is not an instance of.
        ValueError: ``module`` already carries ``patch_cls``.
        RuntimeError: called while ``torch.compile`` traces, or the module's class was
            changed by another tool after an earlier patch.

    Example:
        >>> from torch import nn
        >>> import torchsurgery
        >>> class Frozen(torchsurgery.Patch, nn.Module):
        ...     def __patch_init__(self) -> None:
        ...         self.requires_grad_(False)
        >>> layer = torchsurgery.patch(nn.Linear(2, 2), Frozen)
        >>> layer.weight.requires_grad, isinstance(layer, Frozen)
        (False, True)
        >>> torchsurgery.unpatch(layer).weight.requires_grad
        True
    """
    _undo.check_not_compiling("patch")
    _undo.check_module(module, "torchsurgery.patch")
    _check_patch_class(patch_cls, "patch")
    _undo.check_idle(module, "torchsurgery.patch")
    records = _patch_records(module)
    _check_class_intact(module, records, "patch")
    _check_applicable(module, patch_cls, records)
    before = type(module)
    new_cls = _compose(patch_cls, before)  # may raise TypeError (MRO) before any change
    changes = _apply(module, patch_cls, new_cls, args, kwargs)
    original = records[0].original if records else before
    _undo.push(module, PatchRecord(patch_cls, original, changes))
    return module


def _check_applicable(module: nn.Module, patch_cls: type[Patch], records: list[PatchRecord]) -> None:
    """Refuse ``patch_cls`` where ``module`` is of another class, already carries it, or lacks weight memory it reads."""
    missing = [c for c in _targets(patch_cls) if not issubclass(type(module), c)]
    if missing:
        raise TypeError(
            f"torchsurgery.patch: {patch_cls.__qualname__} is declared for "
            f"{', '.join(c.__qualname__ for c in missing)}, but the module is a "
            f"{(records[0].original if records else type(module)).__qualname__}; "
            "patch an instance of that class, or declare the patch for a base both share"
        )
    if any(r.patch is patch_cls for r in records):
        raise ValueError(
            f"torchsurgery.patch: the module is already patched with {patch_cls.__qualname__}; "
            "unpatch it first to apply it again"
        )
    _check_plain_weights(module, patch_cls)


def _apply(
    module: nn.Module, patch_cls: type[Patch], new_cls: type[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> _undo.ChangeSet:
    """Give ``module`` the class ``new_cls`` and run ``__patch_init__``; what changed, or all put back and raise."""
    before = type(module)
    state = _undo.snapshot(module)
    logs = [(m, _undo.records(m)) for m, _ in state.modules]
    module.__class__ = new_cls
    try:
        with _undo.tracking_writes(state):
            patch_cls.__patch_init__(module, *args, **kwargs)  # type: ignore[arg-type]
    except BaseException:
        _put_back(module, before, state, logs)
        raise
    problem = _outside_the_change_set(module, new_cls, state, logs)
    changes = _undo.diff(state, module)
    holder = _undo.holder_of(changes)
    if holder:
        problem = f"replaced or removed a parameter that {holder} depends on; undo that first, then patch"
    if problem:
        _put_back(module, before, state, logs)
        raise RuntimeError(f"torchsurgery.patch: {patch_cls.__qualname__}.__patch_init__ {problem}")
    return changes


def _record_to_remove(records: list[PatchRecord], patch_cls: type[Patch] | None, internal: bool) -> int:
    """The index of the record :func:`unpatch` removes: ``patch_cls``'s, or the top one of the user's."""
    if patch_cls is None:
        own = [i for i, r in enumerate(records) if not r.internal or internal]
        if not own:
            raise ValueError(
                "torchsurgery.unpatch: the module's only patches belong to a larger surgery "
                "(e.g. an offload); undo that instead"
            )
        return own[-1]
    matches = [i for i, r in enumerate(records) if r.patch is patch_cls]
    if not matches:
        raise ValueError(
            f"torchsurgery.unpatch: the module is not patched with {patch_cls.__qualname__}; "
            f"its patches are {[r.patch.__qualname__ for r in records]}"
        )
    if records[matches[-1]].internal and not internal:
        raise ValueError(
            f"torchsurgery.unpatch: {patch_cls.__qualname__} is part of a larger surgery "
            "(e.g. an offload); undo that instead (handle.remove() or torchsurgery.restore)"
        )
    return matches[-1]


def unpatch(module: M, patch_cls: type[Patch] | None = None, /, *, _internal: bool = False) -> M:
    """Remove the top patch of ``module``, or ``patch_cls`` from anywhere in its stack.

    The module gets back the class it would have without that patch, and everything
    that patch's ``__patch_init__`` changed is put back; patches above it keep working.

    Args:
        module: a patched module.
        patch_cls: the patch to remove; the most recent one when omitted.

    Returns:
        ``module`` itself.

    Raises:
        ValueError: ``module`` is not patched (with ``patch_cls``), or a later patch
            changed something ``patch_cls`` also changed (remove that one first).
        RuntimeError: see :func:`patch`.

    Example:
        >>> from torch import nn
        >>> import torchsurgery
        >>> class A(torchsurgery.Patch, nn.Linear): pass
        >>> class B(torchsurgery.Patch, nn.Linear): pass
        >>> layer = B.from_existing(A.from_existing(nn.Linear(2, 2)))
        >>> [p.__name__ for p in torchsurgery.patches(torchsurgery.unpatch(layer, A))]
        ['B']
    """
    _undo.check_not_compiling("unpatch")
    _undo.check_module(module, "torchsurgery.unpatch")
    _undo.check_idle(module, "torchsurgery.unpatch")
    target, new_cls = _removal(module, patch_cls, _internal)
    target.changes.revert(module)
    module.__class__ = new_cls  # type: ignore[assignment]
    _undo.remove(module, target)
    return module


def check_unpatch(module: nn.Module, patch_cls: type[Patch] | None = None, /) -> None:
    """Raise what ``unpatch(module, patch_cls)`` would refuse with, changing nothing.

    For surgery made of several unpatches (``DynamicSwapInstaller.uninstall_model``), which
    checks them all before the first, so that a refusal leaves every module as it was.

    Example:
        >>> from torch import nn
        >>> from torchsurgery.patching import check_unpatch
        >>> check_unpatch(nn.ReLU())
        Traceback (most recent call last):
        ...
        ValueError: torchsurgery.unpatch: the ReLU module is not patched
    """
    _undo.check_module(module, "torchsurgery.unpatch")
    _removal(module, patch_cls, False)


def _removal(module: nn.Module, patch_cls: type[Patch] | None, internal: bool) -> tuple[PatchRecord, type[nn.Module]]:
    """The record :func:`unpatch` would remove and the class the module would get; raises where it refuses."""
    if patch_cls is not None:
        _check_patch_class(patch_cls, "unpatch")
    records = _patch_records(module)
    if not records:
        raise ValueError(
            f"torchsurgery.unpatch: the {type(module).__qualname__} module is not patched"
        )
    _check_class_intact(module, records, "unpatch")
    index = _record_to_remove(records, patch_cls, internal)
    target, later = records[index], records[index + 1 :]
    overlap = [
        r.patch.__qualname__ for r in later if r.changes.keys() & target.changes.keys()
    ]
    if overlap:
        raise ValueError(
            f"torchsurgery.unpatch: {', '.join(overlap)} (applied after "
            f"{target.patch.__qualname__}) changed the same attributes; unpatch it first"
        )
    holder = _undo.holder_of(target.changes)
    if holder and not internal:
        raise ValueError(
            f"torchsurgery.unpatch: {target.patch.__qualname__} added or converted parameters that {holder} "
            "now depends on; undo that first"
        )
    remaining = [r.patch for r in records if r is not target]
    return target, _chain(records[0].original, remaining)  # _chain may raise (an MRO) before any change


def is_patched(module: nn.Module, patch_cls: type[Patch] | None = None, /) -> bool:
    """Whether ``module`` carries any patch, or ``patch_cls`` in particular.

    Example:
        >>> from torch import nn
        >>> import torchsurgery
        >>> torchsurgery.is_patched(nn.Linear(2, 2))
        False
    """
    _undo.check_module(module, "torchsurgery.is_patched")
    if patch_cls is not None:
        _check_patch_class(patch_cls, "is_patched")
    stack = patches(module)
    return bool(stack) if patch_cls is None else patch_cls in stack


def patches(module: nn.Module) -> list[type[Patch]]:
    """The patches applied to ``module``, bottom (first applied) to top.

    Example:
        >>> from torch import nn
        >>> import torchsurgery
        >>> torchsurgery.patches(nn.ReLU())
        []
    """
    _undo.check_module(module, "torchsurgery.patches")
    return [r.patch for r in _patch_records(module)]


def original_class(module: nn.Module) -> type[nn.Module]:
    """The class ``module`` had before its first patch (its class if unpatched).

    Example:
        >>> from torch import nn
        >>> import torchsurgery
        >>> class P(torchsurgery.Patch, nn.Module): pass
        >>> torchsurgery.original_class(torchsurgery.patch(nn.ReLU(), P)).__name__
        'ReLU'
    """
    _undo.check_module(module, "torchsurgery.original_class")
    records = _patch_records(module)
    return records[0].original if records else type(module)


@contextlib.contextmanager
def patched(
    model: M, targets: Mapping[str | ModuleFilter, type[Patch]], /, *args: Any, **kwargs: Any
) -> Iterator[M]:
    """Patch submodules of ``model`` for the duration of a ``with`` block.

    Every selector is resolved and every patch checked before anything changes; if a
    ``__patch_init__`` raises, the patches already applied are removed again. On exit
    (also on an exception) the patches come off in reverse order.

    Args:
        model: the root module.
        targets: selector -> patch class. A selector is a qualified name, a glob over
            qualified names (``"layers.*.mlp"``, see :mod:`torchsurgery._names`) or a
            filter ``(module, name) -> bool``.
        *args: passed to every ``__patch_init__``.
        **kwargs: passed to every ``__patch_init__``.

    Yields:
        ``model``.

    Raises:
        ValueError: a selector matches no submodule (near matches are listed).
        TypeError: see :func:`patch`.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> class Zero(torchsurgery.Patch, nn.Linear):
        ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
        ...         return torch.zeros_like(super().forward(x))
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> with torchsurgery.patched(model, {"0": Zero, "2": Zero}):
        ...     float(model(torch.ones(1, 2)).abs().sum())
        0.0
        >>> torchsurgery.is_patched(model[0])
        False
    """
    _undo.check_module(model, "torchsurgery.patched")
    plan = _plan(model, targets)
    applied: list[tuple[nn.Module, type[Patch]]] = []
    try:
        for module, patch_cls in plan:
            patch(module, patch_cls, *args, **kwargs)
            applied.append((module, patch_cls))
        yield model
    finally:
        for module, patch_cls in reversed(applied):
            if is_patched(module, patch_cls):
                unpatch(module, patch_cls)


def _plan(model: nn.Module, targets: Mapping[str | ModuleFilter, type[Patch]]) -> list[tuple[nn.Module, type[Patch]]]:
    """Each submodule :func:`patched` patches, with its patch: every selector resolved and checked."""
    if not isinstance(targets, Mapping):
        raise TypeError(
            f"torchsurgery.patched: targets must map selectors to patch classes, e.g. "
            f"{{'layers.*.mlp': MyPatch}}, got a {type(targets).__name__}: {targets!r}"
        )
    plan: list[tuple[nn.Module, type[Patch]]] = []
    for selector, patch_cls in targets.items():
        _check_patch_class(patch_cls, "patched")
        for name, module in select(model, selector, what="torchsurgery.patched"):
            wanted = _targets(patch_cls)
            if not all(isinstance(module, c) for c in wanted):
                raise TypeError(
                    f"torchsurgery.patched: {name or '<root>'} is a {type(module).__qualname__}, "
                    f"but {patch_cls.__qualname__} is declared for "
                    f"{', '.join(c.__qualname__ for c in wanted)}; narrow the selector {selector!r}"
                )
            plan.append((module, patch_cls))
    return plan
