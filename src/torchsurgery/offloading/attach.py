"""Where an offload attaches behaviour to the model's modules, and takes it off again.

Each kind of behaviour is attached by the one means that reaches it:

* a streamed group's root module gets the :class:`~torchsurgery.offloading.streams.StreamedGroup`
  patch (a class swap, recorded in its undo log): its ``forward`` brings the group's weights in;
* the model gets forward hooks around every forward (the lock, the order, the residency
  chosen after the first forward);
* each module holding a weight read as it computes gets a ``state_dict`` post-hook;
* every module gets a :class:`~torchsurgery.offloading.conversion.Conversion` as its ``_apply``.

Everything attached here is taken off by :meth:`Attachments.detach` and
:meth:`Attachments.release_conversions`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from torchsurgery import _undo
from torchsurgery.compact import stored_state
from torchsurgery.offloading.conversion import Conversion, ConvertSubtree, Reinstalling
from torchsurgery.offloading.forward_lock import ForwardLock
from torchsurgery.offloading.streams import (
    AfterFirst,
    EndForward,
    GroupStreamer,
    StartForward,
    StreamedGroup,
    Streaming,
)
from torchsurgery.patching import is_patched, patch, unpatch

__all__ = ["Attachments"]


class Attachments:
    """What one offload attached to a model's modules.

    Attributes:
        streamers: each streamed group's streamer, by the group's name.

    Example:
        >>> from torch import nn
        >>> attached = Attachments()
        >>> attached.show_stored_state(nn.Linear(2, 2))
        >>> len(attached.hooks)
        1
        >>> attached.detach()
        >>> len(attached.hooks)
        0
    """

    def __init__(self) -> None:
        self.hooks: list[Any] = []
        self.patched: list[nn.Module] = []
        self.streamers: dict[str, GroupStreamer] = {}

    def stream(self, name: str, module: nn.Module, streamer: GroupStreamer) -> None:
        """Patch ``module``, the root of the group ``name``, to bring its weights in with ``streamer``."""
        # the one mechanism for a group's own behaviour: its forward brings the weights in and puts them back
        patch(module, StreamedGroup, streamer)
        _undo.records(module)[-1].internal = True
        self.patched.append(module)
        self.streamers[name] = streamer

    def show_stored_state(self, owner: nn.Module) -> None:
        """``owner.state_dict()`` shows the stored values of its weights read as they compute."""
        # a hook stays: owners need not be patched (a class swap would show in patches() and type() for this alone)
        self.hooks.append(owner.register_state_dict_post_hook(stored_state))

    def hook_forwards(self, model: nn.Module, streaming: Streaming, after_first: Callable[[], None] | None) -> None:
        """Hooks around every forward of ``model``: the lock and the order of the streamed groups (if
        any), ``after_first`` after the first forward without gradients."""
        # hooks stay: the lock spans the user's own hooks (prepend, always_call), which a forward cannot;
        # one thread at a time runs the model or converts it, also where no group streams (a
        # conversion takes the offload off and installs it again); the order streamed groups ran in
        # is closed at the end of every forward, after the first one's measurements chose residency
        self.hooks.append(model.register_forward_pre_hook(StartForward(streaming), prepend=True))
        if self.patched and after_first is not None:
            self.hooks.append(model.register_forward_hook(AfterFirst(streaming, after_first)))
        self.hooks.append(model.register_forward_hook(EndForward(streaming), always_call=True))

    def guard_conversions(
        self, modules: Mapping[str, nn.Module], convert: weakref.WeakMethod[ConvertSubtree], lock: ForwardLock
    ) -> None:
        """``.to()``, ``.half()``, ``.cuda()``... of any of ``modules`` go through ``convert``, holding
        ``lock`` (the forwards' own: a conversion waits for the forwards running, and they for it)."""
        for name, module in modules.items():
            # .to(), .half(), .cuda()... would change weights whose values live in this offload
            # behind its back: refused, before anything changes (the instance attribute wins over
            # the class method; removed with the offload)
            # an instance attribute stays: every module needs it, and no hook reaches Module._apply
            # (in place of the stand-in a conversion re-installing the offload put there)
            if "_apply" not in module.__dict__ or isinstance(module.__dict__["_apply"], Reinstalling):
                module.__dict__["_apply"] = Conversion(module, name, convert, lock)

    def detach(self) -> None:
        """Take the hooks and the patches off."""
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        for streamer in self.streamers.values():
            streamer.detached = True  # a thread waiting to bring its group in calls the module as it is now
        for module in reversed(self.patched):
            if is_patched(module, StreamedGroup):
                unpatch(module, StreamedGroup, _internal=True)
        self.patched.clear()
        self.streamers.clear()

    def release_conversions(self, model: nn.Module) -> None:
        """``.to()`` and its kin are the modules' own again."""
        for module in model.modules():
            found = module.__dict__.get("_apply")
            if isinstance(found, Conversion) and not isinstance(found, Reinstalling):  # those go with their conversion
                del module.__dict__["_apply"]

    @staticmethod
    def hold_conversions(model: nn.Module, lock: ForwardLock) -> None:
        """While a conversion re-installs the offload (holding ``lock``): ``.to()`` and its kin of
        another thread wait for it (see :class:`~torchsurgery.offloading.conversion.Reinstalling`).

        Put on before the offload comes off: in place of the installation's own stand-ins, so that
        no ``.to()`` of another thread finds the plain method in between."""
        for name, module in model.named_modules():
            found = module.__dict__.get("_apply")
            if found is None or (isinstance(found, Conversion) and not isinstance(found, Reinstalling)):
                module.__dict__["_apply"] = Reinstalling(module, name, None, lock)

    @staticmethod
    def end_hold(model: nn.Module) -> None:
        """The stand-ins :meth:`hold_conversions` put that the new installation did not replace go."""
        for module in model.modules():
            if isinstance(module.__dict__.get("_apply"), Reinstalling):
                del module.__dict__["_apply"]
