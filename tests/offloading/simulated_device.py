"""A simulated asynchronous device for the offload tests: CUDA's ordering rules, on the host.

"Device" buffers are host tensors. The compute stream is the host itself (PyTorch runs the
model's operations as they are called), so waiting on an event from the compute stream
blocks the host. Every other stream has a worker thread that runs its work in order:
a copy lands after a delay (random within ``delay``, plus ``nbytes / bandwidth``), or, with
``lazy=True``, only once the host waits for it (the most adversarial timing, and
deterministic). Until a copy lands its destination holds poison (0xFF bytes: NaN in every
floating dtype), and a copy reads its source when it lands, so:

* computing on a slot without waiting for its copy's event reads NaN;
* refilling a host buffer before the copy that reads it has landed moves the new bytes;
* a copy into a device buffer that is not ordered after an event recorded on the compute
  stream since the computations last read it raises :class:`Hazard` at once: on a real GPU
  the computations run behind the host and would read the new bytes, which a host-speed
  simulation cannot show as wrong numbers. Reads are seen by a dispatch mode, active while
  the device is used as a context manager.

Copies from host memory that is not pinned are synchronous, as CUDA makes them; they are
counted in ``unpinned_copies``. The simulator lives with the tests rather than in the
package: it exists to check the engine, not to run models, and keeping it out of the
installed library keeps threads and poison out of the public API.
"""

from __future__ import annotations

import collections
import random
import sys
import threading
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from torchsurgery.offloading.device import OffloadDevice

POISON = 0xFF


class Hazard(RuntimeError):
    """A copy that breaks the ordering rules in a way the results cannot show."""


class _Event:
    def __init__(self, stream: _Stream | None, position: int) -> None:
        self.stream = stream  # None: recorded on the compute stream
        self.position = position  # in its stream's work (compute: the host's order)
        self.done = threading.Event()
        self.at = 0.0
        self.site = ""  # where it was recorded

    def complete(self) -> None:
        self.at = time.perf_counter()
        self.done.set()


class _Stream:
    """A side stream: a worker thread running its work in order."""

    def __init__(self, sim: SimulatedDevice, name: str) -> None:
        self.sim = sim
        self.work: collections.deque[tuple[str, Any, int]] = collections.deque()
        self.enqueued = 0  # positions handed out
        self.demand = -1  # lazy: work up to this position is asked for and lands now
        self.waited_compute = -1  # latest compute-stream position this stream waits for
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, kind: str, payload: Any) -> int:
        with self.cond:
            position = self.enqueued
            self.enqueued += 1
            self.work.append((kind, payload, position))
            self.cond.notify_all()
        return position

    def ask(self, position: int) -> None:
        """The host (or another stream) needs the work up to ``position`` now."""
        with self.cond:
            self.demand = max(self.demand, position)
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.work and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                kind, payload, position = self.work[0]
            if kind == "copy":
                dst, src, delay = payload
                deadline = time.perf_counter() + delay  # lazy: never, unless asked for
                with self.cond:
                    while not self.closed:
                        left = deadline - time.perf_counter()
                        if left <= 0 or (self.sim.lazy and self.demand >= position):
                            break
                        self.cond.wait(timeout=None if left == float("inf") else left)
                    if self.closed:
                        return
                dst.copy_(src)  # reads the source now, as a real copy engine would
            elif kind == "record":
                payload.complete()
            elif kind == "wait":
                if payload.stream is not None:
                    payload.stream.ask(payload.position)
                payload.done.wait()
            with self.cond:
                self.work.popleft()
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout=5)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class _Reads(TorchDispatchMode):
    """Notes the compute-stream position at which each device buffer was last used."""

    def __init__(self, sim: SimulatedDevice) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        sim = self.sim
        if not func.is_view:  # taking a view reads nothing
            for value in tree_flatten((args, kwargs or {}))[0]:
                if not isinstance(value, torch.Tensor) or is_traceable_wrapper_subclass(value):
                    continue  # a wrapper (an offloaded host weight) has no memory of its own
                if value.device.type == "cpu" and _storage(value) in sim._device:
                    sim._last_read[_storage(value)] = sim._step()
        return func(*args, **(kwargs or {}))


_LIVE: dict[int, SimulatedDevice] = {}


def _live(key: int) -> SimulatedDevice:
    return _LIVE[key]


class SimulatedDevice(OffloadDevice):
    """An asynchronous device simulated on the host (see the module docstring).

    Args:
        seed: seeds the random copy delays.
        delay: (low, high) seconds added to every copy on a side stream.
        bandwidth: bytes per second of the simulated link (``None``: only ``delay``).
        lazy: copies land only when the host waits for them.
        memory: bytes reported free.
        drop: ``(operation, call site)`` to skip, e.g. ``("wait", "streams.py:123")``: the
            operation does nothing there (a dropped ``record`` gives an event that has
            already completed), as if the engine lacked that line.

    Example:
        >>> import torch
        >>> sim = SimulatedDevice(lazy=True)
        >>> side, buffer = sim.new_stream(), sim.empty(4)
        >>> sim.copy_(buffer, sim.pin(torch.ones(4, dtype=torch.uint8)), side)
        >>> buffer.tolist()  # not waited for: poison
        [255, 255, 255, 255]
        >>> sim.wait(sim.current_stream(), sim.record(side))
        >>> buffer.tolist()
        [1, 1, 1, 1]
        >>> sim.close()
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        delay: tuple[float, float] = (0.0, 0.002),
        bandwidth: float | None = None,
        lazy: bool = False,
        memory: int = 1 << 30,
        drop: tuple[str, str] | None = None,
    ) -> None:
        self.device = torch.device("cpu")
        self.host_compute = False
        self.can_pin = True
        self.delay = delay
        self.bandwidth = bandwidth
        self.lazy = lazy
        self.memory = memory
        self.drop = drop
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()  # call sites seen
        self.ordering: set[str] = set()  # record sites whose events something waited on
        self.copies = 0
        self.unpinned_copies = 0
        self._rng = random.Random(seed)
        self._streams: list[_Stream] = []
        self._pinned: dict[int, torch.UntypedStorage] = {}
        self._device: dict[int, torch.UntypedStorage] = {}
        self._last_read: dict[int, int] = {}  # device storage -> compute position of its last use
        self._compute = 0  # the compute stream's position: one step per record or use
        self._reads = _Reads(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # a copy of a model offloaded onto this device (pickle, torch.save) uses the same device,
        # as a copy of a model on a GPU uses that GPU (within this process)
        _LIVE[id(self)] = self
        return (_live, (id(self),))

    def __deepcopy__(self, memo: dict[int, Any]) -> SimulatedDevice:
        return self

    def __enter__(self) -> SimulatedDevice:
        self._reads.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._reads.__exit__(*exc)
        self.close()

    # ---------------------------------------------------------------- bookkeeping

    def _site(self, operation: str) -> tuple[str, str]:
        frame = sys._getframe(2)
        site = (operation, f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}")
        self.sites[site] += 1
        return site

    def idle(self) -> bool:
        """Whether every copy enqueued so far has landed."""
        return all(not stream.work for stream in self._streams)

    def _step(self) -> int:
        self._compute += 1
        return self._compute

    def close(self) -> None:
        """Stop the worker threads (work not landed yet is dropped)."""
        for stream in self._streams:
            stream.close()
        self._streams.clear()

    # ---------------------------------------------------------------- memory

    def empty(self, nbytes: int) -> torch.Tensor:
        buffer = torch.full((nbytes,), POISON, dtype=torch.uint8)
        self._device[_storage(buffer)] = buffer.untyped_storage()
        return buffer

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self._pinned[_storage(buffer)] = buffer.untyped_storage()
        return buffer

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.clone()
        self._pinned[_storage(copy)] = copy.untyped_storage()
        return copy

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return _storage(tensor) in self._pinned

    def free_memory(self) -> int:
        return self.memory

    # ---------------------------------------------------------------- streams and events

    def current_stream(self) -> Any:
        return None  # the compute stream: the host

    def new_stream(self) -> Any:
        stream = _Stream(self, f"simulated-stream-{len(self._streams)}")
        self._streams.append(stream)
        return stream

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        self.copies += 1
        if stream is None:  # on the compute stream: the host does it now
            dst.copy_(src)
            return
        read = self._last_read.get(_storage(dst))
        if read is not None and stream.waited_compute <= read:
            raise Hazard(
                "simulated device: a copy into a device buffer is not ordered after the computations "
                "that may still read it (wait on an event recorded after them first)"
            )
        if _storage(src) not in self._pinned and _storage(src) not in self._device:
            self.unpinned_copies += 1  # pageable memory: the copy is synchronous
            self.synchronize(stream)
            with torch._C._DisableTorchDispatch():
                dst.copy_(src)
            return
        with torch._C._DisableTorchDispatch():
            dst.view(torch.uint8).fill_(POISON)
        low, high = self.delay
        delay = float("inf") if self.lazy else self._rng.uniform(low, high)
        if self.bandwidth is not None and not self.lazy:
            delay += dst.numel() * dst.element_size() / self.bandwidth
        stream.put("copy", (dst, src, delay))

    def record(self, stream: Any) -> Any:
        site = self._site("record")
        if site == self.drop:
            event = _Event(None, -1)
            event.complete()
        elif stream is None:
            event = _Event(None, self._step())
            event.complete()  # the host has done everything before it
        else:
            event = _Event(stream, stream.enqueued)
            stream.put("record", event)
        event.site = site[1]
        return event

    def wait(self, stream: Any, event: Any) -> None:
        if self._site("wait") == self.drop:
            return
        self.ordering.add(event.site)
        if stream is None:  # the compute stream is the host: it waits
            self._host_wait(event)
            return
        if event.stream is None:  # a compute-stream event has completed already
            stream.waited_compute = max(stream.waited_compute, event.position)
        elif event.stream is not stream:
            stream.put("wait", event)

    def _host_wait(self, event: _Event) -> None:
        if event.stream is not None:
            event.stream.ask(event.position)
        event.done.wait()

    def synchronize(self, what: Any = None) -> None:
        if self._site("synchronize") == self.drop:
            return
        if isinstance(what, _Event):
            self.ordering.add(what.site)
            self._host_wait(what)
        elif isinstance(what, _Stream):
            event = _Event(what, what.enqueued)
            what.put("record", event)
            self._host_wait(event)
        else:
            for stream in list(self._streams):
                self.synchronize(stream)

    def elapsed(self, start: Any, end: Any) -> float:
        self._host_wait(end)
        self._host_wait(start)
        return end.at - start.at
