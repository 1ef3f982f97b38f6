"""``DynamicSwapInstaller``: convert weights on attribute access, done right.

Same call surface as the low-VRAM video app's installer (``install_model``,
``uninstall_model``, ``_install_module``, ``_uninstall_module``), so an application
switches by changing an import. Each module gets a patch (see
:mod:`torchsurgery.patching`) whose ``__getattr__`` returns its parameters and buffers
converted with ``Tensor.to(**kwargs)``. Unlike the original:

* the converted tensor is a differentiable view of the stored parameter (not a new leaf
  ``Parameter``), so training through an installed model updates the stored weights;
* within one forward each weight is converted once, however often the code reads it; the
  copy is differentiable also where it is read under ``torch.no_grad()``, so a weight read
  without gradients and then used with them gets its gradient, as the plain weight does
  (a copy made under ``torch.inference_mode()`` has no graph: a later read that records
  gradients converts again);
* the class is the patch's one cached class per original class, so installed modules
  pickle, compile once per layer type, and uninstall to exactly their original class,
  also after installing twice or on top of other patches; ``forward`` keeps its
  signature (``inspect.signature``), so ``generate()`` passes what it would pass;
* given a ``device`` or a ``dtype``, the stored weights read as tensors on that device in
  that dtype everywhere (``parameters()``, ``model.device``, ``model.dtype``, optimizers),
  so programs that read a model's device from its first parameter (transformers'
  ``generate()``, diffusers pipelines) send their inputs where it computes: each becomes an
  :class:`~torchsurgery.compact.tensor.OffloadedTensor` (the same object) keeping its
  values as they were stored, and ``state_dict()`` holds the stored values, as the
  original installer's does. An attribute read in a forward (``self.weight``) still gives
  what the original gives: a plain tensor, the stored values converted by
  ``Tensor.to(**kwargs)``, which the layer's own kernel multiplies by; so an installed
  model computes bit for bit what the plain model with converted weights computes (the
  narrow products of :func:`~torchsurgery.offload`, which sum in another order, are not
  used). Outside forwards ``module.weight`` is the weight itself, so writes through it
  (``.data =``, pruning, parametrizations, in-place edits) reach the stored values;
* as with ``Module.to``, a ``dtype`` converts floating tensors only (integer buffers such
  as position ids keep theirs);
* installing and uninstalling a model are all or nothing: what would refuse half-way (a
  weight an offload holds; one the graph of a pending backward holds, which the swap would
  poison) refuses before any module changes. Uninstalling does not wait for such graphs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._swap import swap_blocker, swap_in, wrap_like
from torchsurgery.compact import (
    OffloadedTensor,
    offloaded_like,
    plain_reader,
    stored_state,
    stored_values,
)
from torchsurgery.patching import (
    Patch,
    PatchRecord,
    check_unpatch,
    is_patched,
    patch,
    unpatch,
)

__all__ = ["DynamicSwapInstaller"]

_CACHE = "_dynamic_swap_cache"
_KWARGS = "_dynamic_swap_kwargs"
_WHAT = "torchsurgery.DynamicSwapInstaller"


def _target(t: torch.Tensor, kwargs: dict[str, Any]) -> tuple[torch.device, torch.dtype]:
    """Where and in what ``t`` reads once installed with ``kwargs``: a dtype applies to floating tensors only."""
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    to_dtype = dtype if isinstance(dtype, torch.dtype) and t.is_floating_point() else t.dtype
    return (torch.device(device) if device is not None and not t.is_meta else t.device), to_dtype


def _read_as(module: nn.Module, kwargs: dict[str, Any]) -> list[tuple[torch.Tensor, torch.device, torch.dtype]]:
    """The plain tensors of ``module`` itself that installing with ``kwargs`` swaps into OffloadedTensors.

    With their device and dtype: a tensor kept where the conversion would move it, or in
    another dtype than it would convert to, reads as a tensor on that device in that dtype
    (``next(model.parameters()).device`` and ``model.dtype`` then read what the forwards
    compute with), its values staying as they are kept.

    Each checked first: a patch reading weight memory directly, another surgery depending on
    the object (an offload), or the graph of a pending backward (the swap would poison it)
    refuses the installation before anything changes.

    Raises:
        TypeError: a patch of ``module`` reads weight memory directly.
        RuntimeError: a tensor is held by another surgery or by a graph.
    """
    found = []
    for tensors in (module._parameters, module._buffers):
        for name, t in tensors.items():
            if t is None or type(t) not in (torch.Tensor, nn.Parameter):
                continue
            device, dtype = _target(t, kwargs)
            if (device, dtype) == (t.device, t.dtype):
                continue
            reader = plain_reader(module)
            if reader is not None:
                raise TypeError(
                    f"{_WHAT}: cannot keep {name!r} of this {type(module).__name__} as {t.dtype} on {t.device} while it "
                    f"reads as {dtype} on {device}: its patch {reader.__qualname__} reads weight memory directly "
                    "(__patch_needs_plain_weights__); move or convert the module first, or leave it out"
                )
            holder = _undo.holder_of_any([t])
            if holder is not None:
                raise RuntimeError(
                    f"{_WHAT}: cannot make {name!r} of this {type(module).__name__} read as {dtype} on {device}: "
                    f"{holder} keeps it as it is; remove that first (handle.remove()), install, and offload again"
                )
            problem = swap_blocker(name, t, None, _WHAT, weak_references_ok=True)
            if problem:
                raise RuntimeError(problem)
            found.append((t, device, dtype))
    return found


def _converted(tensor: torch.Tensor, fn: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """What ``Module._apply(fn)`` makes of ``tensor`` as it reads, ready to swap in, and what
    uninstalling then gives back (``None``: what it is then); ``None``: unchanged.

    A weight kept in another dtype or place than it reads as is converted from the values it
    reads as (the stored ones, in the read dtype): the conversion is the user's, so
    uninstalling keeps it. Where it read as the device it is installed for and is moved
    there or to where its values are kept (the host), it goes on reading so, its converted
    values kept where its values were (uninstalling gives those back, plain); else it
    becomes a plain tensor.
    """
    if not isinstance(tensor, OffloadedTensor):
        new = fn(tensor)
        return None if new is tensor else (wrap_like(tensor, new), None)
    stored = stored_values(tensor)
    shown = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device))
    # a weight read as the installed device and kept on the host is where .to() puts it
    # either way (FramePack moves installed models to the host between jobs)
    stays = shown.device in (tensor.device, stored.device)
    if shown.dtype == tensor.dtype and stays:
        return None
    kind = nn.Parameter if isinstance(tensor, nn.Parameter) else torch.Tensor
    if stays and tensor.device != stored.device:
        values = stored.to(tensor.dtype).to(shown.dtype)
        return offloaded_like(tensor, values, shown.dtype, device=tensor.device), values
    return wrap_like(tensor, stored.to(tensor.dtype).to(device=shown.device, dtype=shown.dtype), kind), None


def _check_install(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse, changing nothing, what installing ``kwargs`` on ``module`` would refuse half-way."""
    if not kwargs:
        raise ValueError(
            f"{_WHAT}: give the conversion, e.g. device='cuda' or dtype=torch.float16 (the keyword arguments of Tensor.to)"
        )
    try:  # validate early
        torch.empty(0).to(**{k: v for k, v in kwargs.items() if k != "non_blocking"})
    except (TypeError, RuntimeError, AssertionError) as exc:
        raise ValueError(
            f"{_WHAT}: the conversion {kwargs} is not one Tensor.to can do here ({exc}); give an available device and a dtype"
        ) from exc
    dtype = kwargs.get("dtype")
    if isinstance(dtype, torch.dtype) and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(
            f"{_WHAT}: dtype={dtype} would turn weights into integers, which no forward can compute with; "
            "give a floating dtype such as torch.float16"
        )
    if is_patched(module, _DynamicSwap):
        check_unpatch(module, _DynamicSwap)  # the installation it replaces comes off
    _read_as(module, kwargs)


class _DynamicSwap(Patch, nn.Module):
    """Parameters and buffers read through attribute access come back converted."""

    def __patch_init__(self, **to_kwargs: Any) -> None:
        self.__dict__[_KWARGS] = to_kwargs
        # the stored weights read as the device and dtype they compute in (swapped objects,
        # values as stored), and state_dict() shows them as stored; unpatch undoes both, as
        # it undoes everything this method changes
        found = _read_as(self, to_kwargs)
        if found:
            self.register_state_dict_post_hook(stored_state)
        for t, device, dtype in found:
            swap_in(t, offloaded_like(t, t.detach(), dtype, device=device))

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        params, buffers = d.get("_parameters", {}), d.get("_buffers", {})
        if name in params or name in buffers:
            tensor = params[name] if name in params else buffers[name]
            if tensor is None:
                return None
            cache = d.get(_CACHE)
            if cache is not None and name in cache:
                cached = cache[name]
                # a copy made in inference mode has no graph: reuse it only where none is needed
                if cached.requires_grad or not tensor.requires_grad or not torch.is_grad_enabled():
                    return cached
            # as Module.to, a dtype applies to floating tensors only (not to position ids); a meta
            # tensor (an offload streams its values from a file into its forwards) has none to move
            kept = {"dtype": tensor.is_floating_point(), "device": not tensor.is_meta}
            kwargs = {k: v for k, v in d[_KWARGS].items() if kept.get(k, True)}
            if cache is not None and isinstance(tensor, OffloadedTensor):
                # in a forward: it reads as the dtype already, so .to() would return the very
                # tensor and products would read its stored values in place, summing in another
                # order; a plain copy made from the stored values instead, as the plain weight's.
                # Outside forwards the weight itself, so writes through it reach what is stored
                kwargs = {**kwargs, "copy": True}
            # differentiable also when read under no_grad (the plain weight is the same object
            # in every mode): code that reads it so and uses it with gradients gets them to the
            # stored tensor
            with torch.enable_grad():
                value = tensor.to(**kwargs)
            if cache is not None:
                cache[name] = value
            return value
        return super().__getattr__(name)

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        # .to(), .half(), .float()... as on the plain module: each tensor, as it reads (a weight
        # kept in another dtype reads as the installed dtype), converted and swapped into the
        # same object; an installed dtype follows the conversion, so that reads in forwards
        # give the dtype the module was converted to
        if recurse:
            for child in self.children():
                child._apply(fn)
        with torch.no_grad():
            for tensors in (self._parameters, self._buffers):
                for t in tensors.values():
                    done = _converted(t, fn) if t is not None else None
                    if t is not None and done is None:
                        fn(t)  # what it returns changes nothing; what it does in place stays (share_memory_)
                    if t is not None and done is not None:
                        new, given_back = done
                        if isinstance(t, OffloadedTensor):
                            self._give_back_on_uninstall(t, given_back)
                        swap_in(t, new, pending_backward_ok=True)  # as `.data =` on the plain module
            kwargs = self.__dict__[_KWARGS]
            dtype = kwargs.get("dtype")
            if isinstance(dtype, torch.dtype):
                self.__dict__[_KWARGS] = {**kwargs, "dtype": fn(torch.empty(0, dtype=dtype)).dtype}
        return self

    def _give_back_on_uninstall(self, tensor: torch.Tensor, values: torch.Tensor | None) -> None:
        """Uninstalling gives ``tensor`` ``values`` (the user's conversion; ``None``: leaves it as it is then),
        not what it held before it was installed."""
        for record in _undo.records(self):
            if isinstance(record, PatchRecord) and record.patch is _DynamicSwap:
                storage = [e for e in record.changes.storage if e[0] is not tensor]
                kinds = [kind for t, _, kind in record.changes.storage if t is tensor]
                if values is not None and kinds:
                    storage.append((tensor, values.detach(), kinds[0]))
                record.changes.storage = storage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        d = self.__dict__
        owner = _CACHE not in d
        if owner:
            d[_CACHE] = {}  # one conversion per weight per forward
        try:
            return super().forward(*args, **kwargs)
        finally:
            if owner:
                d.pop(_CACHE, None)


def _check_not_under_an_offload(model: nn.Module, verb: str) -> None:
    """Refuse to replace or remove an installation that an offload made since was planned over.

    The offload took the installed weights as they read then (the ones it streams, the ones
    it converts at each run); replacing or removing the installation under it would change
    them behind its back (its forwards then mix devices).
    """
    found = list(_undo.walk(model))
    offloads = [r.seq for _, _, r in found if r.kind == "offload"]
    installed = [(name, r.seq) for name, _, r in found if isinstance(r, PatchRecord) and r.patch is _DynamicSwap]
    under = [name for name, seq in installed if any(o > seq for o in offloads)]
    if under:
        fix = "install again" if verb == "install_model" else "uninstall"
        raise ValueError(
            f"{_WHAT}.{verb}: the installation on {under[0] or '<root>'!r} is under an active offload made "
            f"since, which planned its weights as they read now; remove the offload first (handle.remove()), "
            f"{fix}, and offload again; nothing was changed"
        )


class DynamicSwapInstaller:
    """Keep weights where they are stored; convert them whenever a forward reads them.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(4, 4, dtype=torch.bfloat16))
        >>> torchsurgery.DynamicSwapInstaller.install_model(model, dtype=torch.float32)
        >>> model(torch.ones(1, 4)).dtype, model[0].weight.dtype
        (torch.float32, torch.float32)
        >>> next(model.parameters()).dtype, next(model.parameters()).stored.dtype  # kept as stored
        (torch.float32, torch.bfloat16)
        >>> torchsurgery.DynamicSwapInstaller.uninstall_model(model)
        >>> type(model[0]) is nn.Linear, next(model.parameters()).dtype
        (True, torch.bfloat16)
    """

    @staticmethod
    def _install_module(module: nn.Module, **kwargs: Any) -> None:
        """Install on one module (re-installing replaces the previous conversion); all or nothing."""
        _check_install(module, kwargs)
        with _undo.all_or_nothing(module):  # a failed re-install keeps the installation it replaced
            if is_patched(module, _DynamicSwap):
                unpatch(module, _DynamicSwap)
            patch(module, _DynamicSwap, **kwargs)

    @staticmethod
    def _uninstall_module(module: nn.Module) -> None:
        """Remove the installation from one module (a no-op where there is none)."""
        if is_patched(module, _DynamicSwap):
            unpatch(module, _DynamicSwap)

    @staticmethod
    def installed(module: nn.Module) -> bool:
        """Whether ``module`` itself has the installation.

        Example:
            >>> from torch import nn
            >>> import torchsurgery
            >>> layer = nn.Linear(2, 2)
            >>> torchsurgery.DynamicSwapInstaller.install_model(layer, device="cpu")
            >>> torchsurgery.DynamicSwapInstaller.installed(layer)
            True
            >>> torchsurgery.DynamicSwapInstaller.uninstall_model(layer)
            >>> torchsurgery.DynamicSwapInstaller.installed(layer)
            False
        """
        return is_patched(module, _DynamicSwap)

    @staticmethod
    def install_model(model: nn.Module, **kwargs: Any) -> None:
        """Install on every module of ``model``; all or nothing.

        Args:
            model: the model.
            **kwargs: the conversion, as for ``Tensor.to`` (``device=``, ``dtype=``, ...).

        Raises:
            ValueError: no usable conversion was given, or an installation it replaces cannot
                come off (an offload holds the weights it converted); nothing changed.
            RuntimeError: a weight to read as ``dtype`` is held by an offload or by the graph
                of a pending backward; nothing changed.
            TypeError: a patch reads weight memory directly where ``dtype`` would wrap it.
        """
        _undo.check_module(model, "torchsurgery.DynamicSwapInstaller.install_model")
        for module in model.modules():
            _check_install(module, kwargs)  # a refusal comes before the first module changes
        _check_not_under_an_offload(model, "install_model")
        # what cannot be checked for beforehand (a class that refuses subclasses, an interrupt):
        # every module goes back to what it was, a replaced installation as it was made
        with _undo.all_or_nothing(model):
            for module in model.modules():
                DynamicSwapInstaller._install_module(module, **kwargs)

    @staticmethod
    def uninstall_model(model: nn.Module) -> None:
        """Remove the installation from every module of ``model``; all or nothing.

        Raises:
            ValueError: an offload holds weights the installation converted, or was made over
                the installation since; nothing changed.
        """
        _undo.check_module(model, "torchsurgery.DynamicSwapInstaller.uninstall_model")
        installed = [m for m in model.modules() if is_patched(m, _DynamicSwap)]
        for module in installed:
            check_unpatch(module, _DynamicSwap)  # a refusal comes before the first module changes
        _check_not_under_an_offload(model, "uninstall_model")
        for module in installed:
            unpatch(module, _DynamicSwap)
