"""tardy: the test suite's own PyTorch accelerator, on the CPU, whose copies land late.

A PrivateUse1 backend written in C++ (``tardy.cpp``, which says what it does) and built here
with torch's extension tools. :func:`register` builds it (once per machine and source: torch
caches the build in its extensions directory, ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``), loads it, names it ``tardy`` and registers this module as
``torch.tardy``; ``torch.accelerator`` then reports ``tardy``, so every accelerator path of
torchsurgery runs on it unchanged: ``torch.Stream`` and ``torch.Event``, pinned memory,
asynchronous copies, memory statistics and out-of-memory errors.

It exists to break code that forgets a wait: copies land after random delays (or, lazily, only
when waited for), their destinations hold NaN until then, and touching memory that another
stream used without an event in between raises at once. It lives with the tests, not in the
package: its worker threads and poison are for checking code, not for running models.
Its copy log (:func:`copy_log`) says on which stream each copy ran, whether the host waited
for it and whether it has landed: what may overlap, seen without timing anything.

The suite registers it at start-up where torch reports no accelerator of its own (on a GPU
machine the same tests run on the GPU), and fails if it cannot be built.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

NAME = "tardy"
_SOURCE = Path(__file__).with_name("tardy.cpp")


@dataclass(frozen=True)
class Settings:
    """How the device behaves.

    Attributes:
        capacity: bytes of device memory; an allocation beyond raises ``torch.OutOfMemoryError``.
        delay: (low, high) seconds: each asynchronous copy lands after a delay drawn in between.
        lazy: queued work runs only when something waits for it (the host, or a stream
            waiting on an event); the delays do not apply then.
        seed: seeds the delays.
    """

    capacity: int = 24 << 30  # as a common GPU's (FramePack's pattern keeps 6 GiB free)
    delay: tuple[float, float] = (0.0, 0.001)
    lazy: bool = False
    seed: int = 0


DEFAULT = Settings()
_current = DEFAULT


def _ops() -> Any:
    return torch.ops.tardy


def build() -> str:
    """Compile the backend (or find the cached build) and load it into this process; its path."""
    from torch.utils.cpp_extension import load

    # the name keys torch's build cache: a new torch or a changed source must never load an old build
    digest = hashlib.sha256(torch.__version__.encode() + _SOURCE.read_bytes()).hexdigest()[:8]
    path = load(
        name=f"torchsurgery_tardy_{digest}", sources=[str(_SOURCE)], extra_cflags=["-O2"],
        is_python_module=False, verbose=False,
    )
    return str(path)


def registered() -> bool:
    """Whether this process runs with the tardy device."""
    return torch._C._get_privateuse1_backend_name() == NAME


def register() -> torch.device:
    """Build, load and register the device (once per process); ``tardy:0``.

    Raises:
        RuntimeError: the extension could not be built, or another PrivateUse1 backend is
            registered already.
    """
    if not registered():
        torch.utils.rename_privateuse1_backend(NAME)
        build()
        torch._register_device_module(NAME, sys.modules[__name__])
        configure(_current)
    return torch.device(NAME, 0)


def configure(settings: Settings) -> Settings:
    """Apply ``settings`` (after the work queued so far has run); the settings they replace."""
    global _current
    low, high = settings.delay
    _ops().configure(settings.capacity, float(low), float(high), settings.lazy, settings.seed)
    previous, _current = _current, settings
    return previous


@contextlib.contextmanager
def settings(**changes: Any) -> Iterator[Settings]:
    """The device with ``changes`` to its settings (e.g. ``lazy=True``) inside the block.

    Example:
        >>> with settings(capacity=1 << 20):  # doctest: +SKIP
        ...     torch.empty(1 << 21, dtype=torch.uint8, device="tardy")
        Traceback (most recent call last):
        torch.OutOfMemoryError: tardy: out of memory: ...
    """
    previous = configure(replace(_current, **changes))
    try:
        yield _current
    finally:
        configure(previous)


def hazards() -> list[str]:
    """The hazards found since the last call (memory freed while another stream's use was unordered)."""
    return list(_ops().hazards())


def copies() -> int:
    """Copies issued to the device so far."""
    return int(_ops().counters()[0])


def pageable_copies() -> int:
    """Asynchronous copies issued so far whose source was pageable host memory."""
    return int(_ops().counters()[1])


def in_flight() -> int:
    """Queued work (copies, event records and waits) that has not run yet."""
    return int(_ops().counters()[2])


@dataclass(frozen=True)
class Copy:
    """One copy issued to the device, as :func:`copy_log` reads it.

    Attributes:
        stream: the stream it was issued on (its ``torch.Stream.stream_id``; 0 is the default stream).
        asynchronous: the call returned before the copy ran.
        to_device: its destination is device memory.
        nbytes: the bytes it writes.
        landed: whether it had run when the log was read.
    """

    stream: int
    asynchronous: bool
    to_device: bool
    nbytes: int
    landed: bool


def _logged() -> list[Copy]:
    flat = list(_ops().logged_copies())
    return [
        Copy(stream, bool(asynchronous), bool(to_device), nbytes, bool(landed))
        for stream, asynchronous, to_device, nbytes, landed in zip(*[iter(flat)] * 5, strict=True)
    ]


@contextlib.contextmanager
def copy_log() -> Iterator[Callable[[], list[Copy]]]:
    """Log the copies issued inside the block; the block gets a function reading the log so far.

    Where copies run and what they may overlap, seen without timing anything.

    Example:
        >>> with copy_log() as copies:  # doctest: +SKIP
        ...     x = torch.ones(2, pin_memory=True).to("tardy", non_blocking=True)
        ...     [(c.to_device, c.asynchronous) for c in copies()]
        [(True, True)]
    """
    _ops().log_copies(True)
    try:
        yield _logged
    finally:
        _ops().log_copies(False)


# ---------------------------------------------------------------------- torch.tardy, as torch expects a device module


def is_available() -> bool:
    return registered()


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def is_initialized() -> bool:
    return True


_initialized = True  # read by torch.utils.checkpoint


def synchronize(device: Any = None) -> None:
    torch.accelerator.synchronize(device)


class device:  # torch calls it as torch.<backend>.device
    """Selects the device inside a ``with`` block: there is one, so nothing changes."""

    def __init__(self, index: Any) -> None:
        self.index = index

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _is_in_bad_fork() -> bool:
    return False


def get_amp_supported_dtype() -> list[torch.dtype]:
    """The dtypes autocast may compute in (read by torch.autocast and torch.utils.checkpoint)."""
    return [torch.float16, torch.bfloat16]


def manual_seed(seed: int) -> None:
    """Nothing to seed: the device draws random numbers from the CPU's generator."""


def manual_seed_all(seed: int) -> None:
    """Nothing to seed: the device draws random numbers from the CPU's generator."""


def get_rng_state(device: Any = None) -> torch.Tensor:
    """Empty: the device's random numbers come from the CPU generator, whose state torch saves itself."""
    return torch.empty(0, dtype=torch.uint8)


def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
    """Nothing to restore (see :func:`get_rng_state`)."""
