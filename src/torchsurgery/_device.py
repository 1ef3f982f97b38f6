"""The one seam through which torchsurgery touches a device.

Everything the package does on a device goes through an :class:`OffloadDevice`: the
streaming engine allocates device buffers and page-locked (pinned) host buffers, copies
asynchronously on a stream, makes streams, records and waits on events, synchronises,
queries free memory and times (the seconds between two events); :class:`DevicePool`
reads free memory and whether its device is still there; flex's captures copy
activations to pinned host memory on the stream that computed them; the FramePack layer
empties the allocator's cache. :class:`AcceleratorDevice` implements it with PyTorch's
device-generic accelerator API (``torch.accelerator``, ``torch.Stream``, ``torch.Event``),
so CUDA, ROCm (which PyTorch reports as ``cuda``), XPU, MPS and any registered backend take
the same path; where a backend offers no streams, copies are synchronous. On ``cpu`` every
copy is synchronous and events are host timestamps.

What the seam is for: one place that says what torchsurgery asks of a device. It stays
(rather than each module calling ``torch.accelerator``) because it is public
(``offload(device=...)`` takes an :class:`OffloadDevice`), and because with every device call
behind it the test suite's device (``tests/tardy``, a registered backend) runs the very code
a GPU runs, and a test can wrap :class:`AcceleratorDevice` to drop one wait and see it caught.
It sits at the package root, shared, because three rooms use it (offloading, flex, compat);
:class:`OffloadDevice` is public as ``torchsurgery.OffloadDevice``.
"""

from __future__ import annotations

import abc
import functools
import os
import time
from typing import Any

import torch

from torchsurgery._validate import check_device


def host_available_memory() -> int:
    """Host memory the system reports available now (``MemAvailable``; else free pages), in bytes.

    Example:
        >>> host_available_memory() > 0
        True
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

class OffloadDevice(abc.ABC):
    """Where an offloaded model computes, and every device operation the engine needs.

    Streams and events are opaque handles: the engine only passes them back to the same
    object. Work on one stream runs in order; :meth:`wait` orders a stream after an event
    recorded on another; the host sees a copy's result once it waited for an event
    recorded after the copy (on the compute stream, or with :meth:`synchronize`).

    Attributes:
        device: the ``torch.device`` that device buffers and computations live on.
        host_compute: whether device memory *is* host memory (``cpu``): a group stored in
            its compute dtype then needs no copy at all.
        can_pin: whether page-locked host buffers can be allocated.
        allocation_granule: the bytes each device allocation is rounded up to in the
            device's memory statistics (an offload's budget counts allocations so).

    Example:
        >>> import torch
        >>> from torchsurgery._device import resolve_device
        >>> dev = resolve_device("cpu", "example")
        >>> buffer = dev.empty(4)
        >>> side = dev.new_stream()
        >>> start = dev.record(side)
        >>> dev.copy_(buffer, torch.arange(4, dtype=torch.uint8), side)
        >>> dev.wait(dev.current_stream(), dev.record(side))
        >>> buffer.tolist(), dev.elapsed(start, dev.record(side)) >= 0
        ([0, 1, 2, 3], True)
    """

    device: torch.device
    host_compute: bool
    can_pin: bool
    allocation_granule: int = 1

    @abc.abstractmethod
    def empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialised ``uint8`` buffer of ``nbytes`` on the device."""

    @abc.abstractmethod
    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialised page-locked host ``uint8`` buffer (raises where :attr:`can_pin` is False)."""

    @abc.abstractmethod
    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked host copy of ``tensor``."""

    @abc.abstractmethod
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in page-locked host memory."""

    @abc.abstractmethod
    def current_stream(self) -> Any:
        """The stream computations run on."""

    @abc.abstractmethod
    def new_stream(self) -> Any:
        """A stream for copies that may overlap computations."""

    @abc.abstractmethod
    def copy_(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Enqueue ``dst.copy_(src)`` on ``stream``; ``dst`` holds the result once an event after it completes."""

    @abc.abstractmethod
    def record(self, stream: Any) -> Any:
        """An event that completes when the work enqueued on ``stream`` so far has completed."""

    @abc.abstractmethod
    def wait(self, stream: Any, event: Any) -> None:
        """Order the work enqueued on ``stream`` from now on after ``event``."""

    @abc.abstractmethod
    def synchronize(self, what: Any = None) -> None:
        """Block the host until ``what`` (an event or a stream; ``None``: the device) completed."""

    @abc.abstractmethod
    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds between two events recorded in order (waits for ``end``)."""

    @abc.abstractmethod
    def free_memory(self) -> int:
        """Bytes of device memory free for allocation now."""


class _Stamp:
    """An event of a device without streams: a host timestamp, taken once the device is idle."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = time.perf_counter()


class AcceleratorDevice(OffloadDevice):
    """``cpu`` or the accelerator PyTorch reports, through ``torch.accelerator``.

    Making one touches no device: whether it has streams and can pin host memory is found
    out at first use (so that a device object costs nothing where no work follows).

    Example:
        >>> dev = AcceleratorDevice(torch.device("cpu"))
        >>> dev.host_compute, dev.can_pin
        (True, False)
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host_compute = device.type == "cpu"
        # PyTorch's caching allocators (CUDA, ROCm, XPU) round every block to 512 bytes, and
        # max_memory_allocated() counts the rounded sizes
        self.allocation_granule = 1 if self.host_compute else 512

    @functools.cached_property
    def can_pin(self) -> bool:  # type: ignore[override]
        return not self.host_compute and _pinning_works()

    @functools.cached_property
    def _streams(self) -> bool:
        if self.host_compute:
            return False
        try:
            torch.Stream(device=self.device)
        except (RuntimeError, NotImplementedError):  # e.g. a backend with one queue only
            return False
        return True

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def current_stream(self) -> Any:
        return torch.accelerator.current_stream(self.device) if self._streams else None

    def new_stream(self) -> Any:
        return torch.Stream(device=self.device) if self._streams else None

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        if stream is None:
            dst.copy_(src)
            return
        with stream:
            dst.copy_(src, non_blocking=True)

    def record(self, stream: Any) -> Any:
        if stream is None:
            if not self.host_compute:
                torch.accelerator.synchronize(self.device)  # no streams: time what the device did
            return _Stamp()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        if stream is not None:
            stream.wait_event(event)

    def synchronize(self, what: Any = None) -> None:
        if isinstance(what, torch.Event | torch.Stream):
            what.synchronize()
        elif not self.host_compute:
            torch.accelerator.synchronize(self.device)

    def elapsed(self, start: Any, end: Any) -> float:
        if isinstance(end, _Stamp):
            return end.at - start.at
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    def free_memory(self) -> int:
        if self.host_compute:
            raise RuntimeError("torchsurgery.offload: free memory of the host is not tracked; give a budget")
        try:
            free, _ = torch.accelerator.get_memory_info(self.device)
        except (RuntimeError, NotImplementedError) as exc:
            raise RuntimeError(
                f"torchsurgery.offload: free memory of {str(self.device)!r} is unknown to this PyTorch ({exc}); give a budget"
            ) from exc
        return int(free)

    def available_bytes(self) -> int:
        """Bytes a new allocation can take now.

        On an accelerator: what the device reports free plus what torch's caching allocator
        holds unused. On a CPU: the host's available memory (``MemAvailable``).
        """
        if not self.host_compute:
            free, _ = torch.accelerator.get_memory_info(self.device)
            stats = torch.accelerator.memory_stats(self.device)
            return int(free + stats.get("reserved_bytes.all.current", 0) - stats.get("active_bytes.all.current", 0))
        return host_available_memory()

    def missing(self) -> str | None:
        """Why the device is not there any more (PyTorch stopped reporting it), or ``None``."""
        if self.host_compute:
            return None
        accelerator = reported_accelerator()
        if accelerator is None or accelerator.type != self.device.type:
            return f"this PyTorch reports {'no accelerator' if accelerator is None else repr(accelerator.type)}"
        count = torch.accelerator.device_count()
        if (self.device.index or 0) >= count:
            return f"there are only {count} {self.device.type} devices"
        return None

    def empty_cache(self) -> None:
        """Give the memory the caching allocator holds unused back to the device (a no-op on ``cpu``,
        and before the device's allocator is initialised)."""
        if not self.host_compute:
            with torch.accelerator.device_index(self.device.index):
                torch.accelerator.empty_cache()

    def to_host(self, tensor: torch.Tensor, stream: Any) -> torch.Tensor:
        """A page-locked host copy of the device tensor ``tensor``, issued on ``stream`` without
        blocking: it holds the values once ``stream`` is synchronised."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.copy_(host, tensor, stream)
        return host


def _pinning_works() -> bool:
    try:
        torch.empty(1, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        return False
    return True


def reported_accelerator() -> torch.device | None:
    """The accelerator PyTorch reports (a ``torch.device`` without index), or ``None``.

    Example:
        >>> reported_accelerator() is None or reported_accelerator().type != "cpu"
        True
    """
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None


def accelerator_device(device: str | torch.device, what: str) -> AcceleratorDevice:
    """The :class:`AcceleratorDevice` for ``device``: ``cpu`` or an accelerator PyTorch reports,
    with the current index where ``device`` names none.

    Raises:
        ValueError: not a device, no such device on this machine, or ``meta``.

    Example:
        >>> accelerator_device("cpu", "example").device
        device(type='cpu')
    """
    target = check_device(device, what)
    assert target is not None
    if target.type == "cpu":
        return AcceleratorDevice(torch.device("cpu"))
    if target.type == "meta":
        raise ValueError(f"{what}: cannot compute on the 'meta' device; use 'cpu' or an accelerator")
    index = torch.accelerator.current_device_index() if target.index is None else target.index
    return AcceleratorDevice(torch.device(target.type, index))


def resolve_device(device: str | torch.device | OffloadDevice, what: str) -> OffloadDevice:
    """The :class:`OffloadDevice` for ``device``: ``cpu`` or an accelerator PyTorch reports.

    Args:
        device: a device name (``"cuda"``, ``"xpu:1"``, ``"mps"``, ``"cpu"``), a
            ``torch.device``, or an :class:`OffloadDevice` (returned as is).
        what: the calling function's name, for error messages.

    Raises:
        ValueError: not a device, or no such device on this machine.

    Example:
        >>> resolve_device("cpu", "example").device
        device(type='cpu')
    """
    if isinstance(device, OffloadDevice):
        return device
    return accelerator_device(device, what)
