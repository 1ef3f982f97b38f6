"""Where captured activations go: ``output_ptr``, by way of the forward that made them.

Each forward through a wrapper is a :class:`ForwardCall`, kept in a context variable, so
concurrent forwards (threads, async tasks) on one wrapper each have their own group
choice and their own captures. A forward's captures reach ``output_ptr`` together when it
returns (:meth:`Captures.publish`), and not at all when it fails. Hooks that run outside
a forward (``generate`` calling the model's parts, a backward) write straight to
``output_ptr``.

Inside a forward, activations on the accelerator PyTorch reports are copied into pinned
host memory without blocking, on the stream that computed them; the forward waits for
those streams once, when it returns. The copies go through the device seam
(:class:`~torchsurgery._device.AcceleratorDevice`), as every device call of the package.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Set
from typing import Any

import torch

from torchsurgery._device import AcceleratorDevice, reported_accelerator
from torchsurgery.flex.hook_function import HookFunction

__all__ = ["OutputPtr", "ForwardCall", "Captures"]

OutputPtr = dict[str, list[torch.Tensor]]
"""flex_model's capture dict: module name to one CPU tensor per forward."""


class ForwardCall:
    """What belongs to one forward through the wrapper: its group choice and its captures.

    Attributes:
        active: the hook functions that run (``None``: every one).
        captures: what this forward captured so far.
        pending: the streams that non-blocking device-to-host copies were issued on, each
            with its device.
        devices: the devices of the accelerator PyTorch reports this forward's captures came
            from (made once per forward).
    """

    __slots__ = ("active", "captures", "pending", "devices")

    def __init__(self, active: Set[HookFunction] | None) -> None:
        self.active = active
        self.captures: OutputPtr = {}
        self.pending: list[tuple[AcceleratorDevice, Any]] = []
        self.devices: dict[torch.device, AcceleratorDevice | None] = {}

    def accelerated(self, device: torch.device) -> AcceleratorDevice | None:
        """``device`` as the seam has it, if it belongs to the accelerator PyTorch reports (its
        host memory can be pinned), else ``None``."""
        if device not in self.devices:
            accelerator = reported_accelerator()
            self.devices[device] = AcceleratorDevice(device) if accelerator is not None and device.type == accelerator.type else None
        return self.devices[device]


class Captures:
    """CPU copies of activations, kept per forward and appended to ``output_ptr``.

    Example:
        >>> out = {}
        >>> captures = Captures(out)
        >>> call, token = captures.begin(None)
        >>> captures.capture("fc", torch.ones(2))
        >>> out  # nothing yet: the forward has not returned
        {}
        >>> captures.end(call, token); captures.publish(call)
        >>> out["fc"][0].tolist()
        [1.0, 1.0]
    """

    def __init__(self, output_ptr: OutputPtr) -> None:
        self.output_ptr = output_ptr
        self._fresh()

    def _fresh(self) -> None:
        self._call: contextvars.ContextVar[ForwardCall] = contextvars.ContextVar("torchsurgery_flex_call")
        self._lock = threading.Lock()  # output_ptr is appended to from several threads

    def __getstate__(self) -> dict[str, Any]:
        # a copy (deepcopy, pickle) gets its own call variable and lock
        return {k: v for k, v in self.__dict__.items() if k not in ("_call", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()

    def begin(self, active: Set[HookFunction] | None) -> tuple[ForwardCall, contextvars.Token[ForwardCall]]:
        """Start a forward in this context; give the token back to :meth:`end`."""
        call = ForwardCall(active)
        return call, self._call.set(call)

    def end(self, call: ForwardCall, token: contextvars.Token[ForwardCall]) -> None:
        """Leave the forward :meth:`begin` started, its copies finished (not yet published)."""
        self._call.reset(token)
        for device, stream in call.pending:
            device.synchronize(stream)

    def runs(self, hook: HookFunction) -> bool:
        """Whether ``hook`` is on in the current forward (outside one, every hook is)."""
        call = self._call.get(None)
        return call is None or call.active is None or hook in call.active

    def capture(self, key: str, tensor: torch.Tensor, into: OutputPtr | None = None) -> None:
        """Keep a CPU copy of ``tensor`` under ``key``: in ``into``, in this forward's
        captures (they reach ``output_ptr`` when it returns), or straight in ``output_ptr``."""
        call = self._call.get(None)
        value = tensor.detach()
        if value.device.type == "cpu":
            value = value.clone()  # an alias would change with later in-place edits
        elif call is not None and (device := call.accelerated(value.device)) is not None:
            # pinned and non-blocking; end() waits for the stream once when the forward returns
            stream = device.current_stream()
            value = device.to_host(value, stream)
            if (device, stream) not in call.pending:
                call.pending.append((device, stream))
        else:
            value = value.to("cpu")
        if into is not None:
            into.setdefault(key, []).append(value)
        elif call is not None:
            call.captures.setdefault(key, []).append(value)
        else:
            with self._lock:
                self.output_ptr.setdefault(key, []).append(value)

    def publish(self, call: ForwardCall) -> None:
        """Append the captures of a forward that returned to ``output_ptr``."""
        if call.captures:
            with self._lock:
                for key, values in call.captures.items():
                    self.output_ptr.setdefault(key, []).extend(values)
