"""Models streamed from their checkpoint files, in the FramePack functions: their place when not on the device.

A model whose weights stream from checkpoint files (``torchsurgery.from_pretrained``, or a
:func:`~torchsurgery.skeleton` given ``offload(model, storage=folder)``) holds no weights in
host memory: there is nothing to move. It comes with its *base* offload, which stands for
"on the host": computing where that offload computes (the host), every weight read from
its files at use. :mod:`torchsurgery.compat.framepack` keeps that meaning:

* brought to a device (a move, a load), the base comes off (the weights are ``meta`` again,
  nowhere) and the model joins the device's pool streaming from the same files: groups
  resident as the room allows, the rest read from the files at each forward;
* taken out of that pool (pushed back to the host, unloaded), its base goes on again, so
  the model runs on the host as a model moved back with ``.to("cpu")`` does;
* the :class:`DynamicSwapInstaller` (the app's way to run a model on a small GPU with its
  weights on the host, read onto the device at use) makes the base an offload to the
  installer's device with every group streamed from the files; uninstalling puts the host
  base back;
* on a CPU target the base already computes where the model would go: nothing moves.

The weights are never materialised: outside its forwards a streamed model's weights are
``meta`` tensors, whichever of these states it is in.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery.offloading import DevicePool, OffloadHandle, offload
from torchsurgery.offloading import DynamicSwapInstaller as _Installer

__all__ = ["Base", "streamed", "on_host", "take_off", "put_back", "DynamicSwapInstaller"]

# what a pool's add() takes of an offload's options (the rest: the pool's own)
_POOL_OPTIONS = ("dtype", "groups", "skip", "prefetch", "pin_memory", "storage", "host_budget")


@dataclass
class Base:
    """A streamed model's base offload, while off: what puts it on again.

    Attributes:
        device: where it computes (the host, or an installer's device).
        options: its :func:`~torchsurgery.offload` keywords (``storage`` among them).
    """

    device: torch.device
    options: dict[str, Any]


# weak: a model the app drops is freed
# the base of each streamed model whose base is off (in a pool, or being replaced)
_off: weakref.WeakKeyDictionary[nn.Module, Base] = weakref.WeakKeyDictionary()
# the host base of each streamed model whose base is an installer's, for uninstalling
_hosts: weakref.WeakKeyDictionary[nn.Module, Base] = weakref.WeakKeyDictionary()


def _file_offload(model: nn.Module) -> OffloadHandle | None:
    """``model``'s active offload when it streams from a checkpoint file and no pool made it."""
    if DevicePool.holding(model) is not None:
        return None
    for record in _undo.records(model):
        handle = getattr(record, "handle", None) if record.kind == "offload" else None
        if isinstance(handle, OffloadHandle) and handle.active and handle.plan.storage is not None:
            return handle
    return None


def streamed(model: nn.Module) -> bool:
    """Whether ``model``'s weights stream from checkpoint files (its base on, or off while pooled)."""
    return model in _off or _file_offload(model) is not None


def on_host(model: nn.Module) -> bool:
    """Whether ``model`` is streamed with its base on the host (where a CPU target's pool would put it)."""
    handle = _file_offload(model)
    return handle is not None and handle.device.type == "cpu"


def take_off(model: nn.Module) -> dict[str, Any]:
    """Take a streamed model's base off (its weights ``meta``, in their files) and return the
    options to add it to a pool with; ``{}`` for any other model."""
    handle = _file_offload(model)
    if handle is not None:
        # what it was offloaded with (budget included); a dtype conversion since is planned
        # again when the converting code runs again (as FramePack's output switch does)
        _off[model] = Base(handle.device, dict(handle._options))
        handle.remove()
    base = _off.get(model)
    if base is None:
        return {}
    # its own host budget goes with it (none given: its share of the pool's)
    options = {k: base.options[k] for k in _POOL_OPTIONS if k in base.options}
    return {k: v for k, v in options.items() if k != "host_budget" or v is not None}


def put_back(model: nn.Module) -> None:
    """Put a streamed model's base on again, once no pool holds it (a no-op for any other model)."""
    base = _off.get(model)
    if base is None or DevicePool.holding(model) is not None:
        return
    offload(model, base.device, **base.options)
    del _off[model]


def _replace_base(model: nn.Module, base: Base) -> None:
    """Make ``base`` the base of the streamed ``model`` (its weights stay in their files)."""
    take_off(model)
    _off[model] = base
    put_back(model)


def _installer_base(model: nn.Module, device: torch.device, kwargs: dict[str, Any]) -> Base:
    """The base of ``model`` under the installer: an offload to ``device`` (in the installer's
    ``dtype``, if given) with every group streamed from the files (the least it runs in)."""
    take_off(model)
    host = _off[model]
    _hosts.setdefault(model, host)
    options = {**host.options, "dtype": kwargs.get("dtype", host.options.get("dtype"))}
    if device.type == "cpu":  # it computes on the host already, reading the files at use
        return Base(device, options)
    # the least budget the offload takes, every group streamed, also after the model converts a
    # weight in its forward (the app's transformer: proj_out to fp32)
    return Base(device, {**options, "budget": "least"})


class DynamicSwapInstaller(_Installer):
    """:class:`torchsurgery.DynamicSwapInstaller`, also for models streamed from their files.

    On a streamed model, installing makes it compute on the installer's ``device`` (in its
    ``dtype``, if given) with every weight read from the files onto the device at use, as
    the app's installer reads host weights onto the device; uninstalling puts it back
    on the host. Any other model gets the installer itself.

    Example:
        >>> from torch import nn
        >>> from torchsurgery.compat.framepack import DynamicSwapInstaller
        >>> layer = nn.Linear(2, 2)
        >>> DynamicSwapInstaller.install_model(layer, device="cpu")
        >>> DynamicSwapInstaller.installed(layer)
        True
        >>> DynamicSwapInstaller.uninstall_model(layer)
    """

    @staticmethod
    def installed(module: nn.Module) -> bool:
        """Whether ``module`` has the installation (on a streamed model: its base is the installer's)."""
        return module in _hosts or _Installer.installed(module)

    @staticmethod
    def install_model(model: nn.Module, **kwargs: Any) -> None:
        """Install on every module of ``model``, or (streamed) make its base the installer's; all or nothing."""
        if not streamed(model) or DevicePool.holding(model) is not None:
            _Installer.install_model(model, **kwargs)
            return
        device = torch.device(kwargs.get("device") or "cpu")
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, 0)
        _replace_base(model, _installer_base(model, device, kwargs))

    @staticmethod
    def uninstall_model(model: nn.Module) -> None:
        """Remove the installation (on a streamed model: its base goes back to the host)."""
        host = _hosts.pop(model, None)
        if host is None:
            _Installer.uninstall_model(model)
            return
        take_off(model)
        _replace_base(model, Base(host.device, host.options))
