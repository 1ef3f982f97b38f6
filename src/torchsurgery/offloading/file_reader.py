"""Reading streamed groups from their checkpoint files ahead of use, at the disk's speed.

A :class:`FileReader` serves the groups an offload streams from a checkpoint file
(``offload(storage=...)``). Each group's bytes come into one buffer laid out as its ring slot
is, so a CPU computes on views of it and an accelerator copies it in one transfer. Reads
run on a few threads, split in pieces of at most ``_PIECE`` bytes (several in flight), ahead
of use along the recorded execution order (model order in the first forward), across the
end of one forward into the next, while the model computes. At most ``buffers`` read buffers
exist (aligned to 4096 bytes and reused; pinned where a device copies from them).

Groups of the host tier (:mod:`~torchsurgery.offloading.host_tier`) are read once into a
buffer of their own and kept; the others are read on every forward. When the files hold
more than the host keeps, reads bypass the page cache (``O_DIRECT``: aligned ranges into an
aligned buffer, trimmed to the tensors' bytes), so streaming a model larger than memory
does not evict everything else; a filesystem that refuses direct I/O (tmpfs) is read
through the page cache instead. Bytes are the file's bytes either way. A group kept in a
narrower format than the file's (``offload(storage=..., storage_dtype=...)``) lands in its read
buffer as the file stores it and is converted there, in place, as it lands
(:mod:`~torchsurgery.offloading.file_format`; read buffers hold the file's bytes, as without a
``storage_dtype``); a kept one is converted into its own buffer: the host tier keeps, and
counts, the converted bytes.

Thread safety: the model's forward lock serializes every call but the reads themselves;
a read thread writes only into the buffer it was given. A read's error is raised by
:meth:`FileReader.take` in the forward that needs its group, naming the file. :meth:`close`
stops the reads that have not started and waits for those that have.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchsurgery import _checkpoint
from torchsurgery._checkpoint import CheckpointError
from torchsurgery._device import OffloadDevice
from torchsurgery.offloading.host_tier import HostAccount, fill
from torchsurgery.offloading.order import OrderRecorder
from torchsurgery.offloading.stats import OffloadStats

__all__ = ["FileReader", "read_buffers", "reader_bytes"]

_ALIGN = 4096  # what direct I/O asks of offsets, lengths and buffer addresses
_PIECE = 32 << 20  # bytes one read asks for: a group's reads are several of these, in flight together
_THREADS = 4  # reads wait on the disk: more in flight than cores
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)  # a filesystem without direct I/O
_BOUNCE = _PIECE + 2 * _ALIGN  # a thread's buffer for direct reads: a piece and its alignment on both ends


def read_buffers(prefetch: int, host_compute: bool = False) -> int:
    """The read buffers a :class:`FileReader` of an offload at ``prefetch`` makes at most: one more
    than the ring's slots on an accelerator (one group computes, one lands, one is read); as many
    as the slots where the host computes (``host_compute``: a group computes on its read buffer,
    the next ones are read; nothing lands).

    Example:
        >>> read_buffers(1), read_buffers(1, host_compute=True)
        (3, 2)
    """
    return prefetch + (1 if host_compute else 2)


def reader_bytes(largest: int, prefetch: int, host_compute: bool = False) -> int:
    """Host bytes a :class:`FileReader` of an offload at ``prefetch`` holds at most besides the groups
    the host tier keeps, where the largest group it reads on every forward takes ``largest`` bytes.

    Its :func:`read_buffers` (``host_compute`` as there), each that large, and each reading thread's buffer for direct reads, of
    which a read fills at most one piece (a group's bytes, at most ``_PIECE``) and its alignment; every
    allocation with its alignment slack. 0 where it reads nothing on every forward.

    Example:
        >>> reader_bytes(0, 1), reader_bytes(1000, 1) == 3 * (1000 + 4096) + 4 * (1000 + 3 * 4096)
        (0, True)
        >>> reader_bytes(1000, 1, host_compute=True) == 2 * (1000 + 4096) + 4 * (1000 + 3 * 4096)
        True
    """
    if not largest:
        return 0
    return read_buffers(prefetch, host_compute) * (largest + _ALIGN) + _THREADS * (min(largest, _PIECE) + 3 * _ALIGN)


def _open_direct(path: Path) -> int:
    """``path`` opened for reads that bypass the page cache (raises where that is refused)."""
    return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))


def _aligned(nbytes: int, allocate: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """``nbytes`` of ``uint8`` from ``allocate`` starting at a multiple of 4096 bytes."""
    raw = allocate(nbytes + _ALIGN)
    shift = -raw.data_ptr() % _ALIGN
    return raw[shift : shift + nbytes]


@dataclass(frozen=True)
class _Span:
    """One tensor's bytes: where they are in the file and where they go in the group's buffer."""

    start: int
    nbytes: int
    offset: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass(frozen=True)
class _Piece:
    """One read: bytes ``[start, end)`` of ``path`` (file-contiguous tensors, or part of one)."""

    path: Path
    start: int
    end: int
    spans: tuple[_Span, ...]


def _pieces(group: Any) -> list[_Piece] | None:
    """The reads that bring ``group`` (a packed group from a file) into its buffer, in file order;
    ``None`` where a weight is cast on its way in (the plain read does that)."""
    located = []
    for key, slot in zip(group.keys, group.file_layout.slots, strict=True):
        path, start, nbytes, dtype = group.source.locate(key)
        if dtype != slot.dtype or nbytes != slot.nbytes:
            return None
        if nbytes:
            located.append((path, _Span(start, nbytes, slot.offset)))
    located.sort(key=lambda item: (str(item[0]), item[1].start))
    pieces: list[_Piece] = []
    run: list[_Span] = []
    for i, (path, span) in enumerate(located):
        run.append(span)
        following = located[i + 1] if i + 1 < len(located) else None
        if following is None or following[0] != path or following[1].start != span.end:
            for lo in range(run[0].start, span.end, _PIECE):
                hi = min(span.end, lo + _PIECE)
                pieces.append(_Piece(path, lo, hi, tuple(s for s in run if s.start < hi and s.end > lo)))
            run = []
    return pieces


class _Files:
    """The checkpoint's files, opened for direct reads where the filesystem allows and asked."""

    def __init__(self, paths: set[Path], direct: bool) -> None:
        self._fds: dict[Path, tuple[int, bool]] = {}
        self._stale: list[int] = []
        self._lock = threading.Lock()
        try:
            for path in sorted(paths):
                self._fds[path] = self._open(path, direct)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _open(path: Path, direct: bool) -> tuple[int, bool]:
        if direct:
            try:
                return _open_direct(path), True
            except OSError as exc:
                if exc.errno not in _REFUSED:
                    raise
        return os.open(path, os.O_RDONLY), False

    @property
    def direct(self) -> bool:
        """Whether some file is read past the page cache."""
        return any(d for _, d in self._fds.values())

    def fd(self, path: Path) -> tuple[int, bool]:
        """The descriptor to read ``path`` with, and whether it reads directly."""
        with self._lock:
            return self._fds[path]

    def refuse_direct(self, path: Path) -> None:
        """Read ``path`` through the page cache from now on (its filesystem refused a direct read)."""
        with self._lock:
            fd, direct = self._fds[path]
            if direct:
                self._stale.append(fd)  # another thread may be reading with it now
                self._fds[path] = self._open(path, False)

    def close(self) -> None:
        for fd in [fd for fd, _ in self._fds.values()] + self._stale:
            os.close(fd)
        self._fds.clear()
        self._stale.clear()


@dataclass(eq=False)
class _Read:
    """A group's read in flight: its buffer and one future per piece."""

    name: str
    buffer: torch.Tensor
    futures: list[concurrent.futures.Future[None]]
    keep: bool  # into the group's host-tier buffer, kept once done
    started: float = 0.0  # by the checkpoint's clock, for the reads' speed (the slow-filesystem hint)
    nbytes: int = 0  # read from the files (a split group's kept bytes are not)
    raw: torch.Tensor | None = None  # where the pieces land: ``buffer``, or the file's bytes to convert into it


def _normal_tensors(allocate: Callable[[int], torch.Tensor]) -> Callable[[int], torch.Tensor]:
    """``allocate`` giving normal tensors also under ``torch.inference_mode`` (a forward's): the
    reading threads, outside that mode, write into them."""

    def normal(n: int) -> torch.Tensor:
        with torch.inference_mode(False):
            return allocate(n)

    return normal


@dataclass(frozen=True)
class _Segment:
    """Bytes a split group keeps: ``nbytes`` at ``at`` in what it keeps belong at ``offset`` in its buffer."""

    offset: int
    at: int
    nbytes: int


def _split(pieces: list[_Piece], kept: int) -> tuple[list[_Segment], list[_Piece]]:
    """The first ``kept`` bytes of ``pieces`` (a group's reads, in file order) as segments of the
    group's buffer, and the reads of the rest."""
    segments: list[_Segment] = []
    rest: list[_Piece] = []
    at = 0
    for piece in pieces:
        mid = min(piece.end, piece.start + max(0, kept - at))
        for s in piece.spans:
            first, last = max(piece.start, s.start), min(mid, s.end)
            if first < last:
                segments.append(_Segment(s.offset + first - s.start, at + first - piece.start, last - first))
        if mid < piece.end:
            rest.append(_Piece(piece.path, mid, piece.end, tuple(s for s in piece.spans if s.end > mid)))
        at += mid - piece.start
    return segments, rest


def _fill(buffer: torch.Tensor, part: torch.Tensor, segments: list[_Segment]) -> None:
    """A split group's kept bytes to their places in ``buffer``."""
    for seg in segments:
        buffer[seg.offset : seg.offset + seg.nbytes].copy_(part[seg.at : seg.at + seg.nbytes])


_clock = time.perf_counter  # how long a forward waited for a group's bytes (its stall)
_GAIN = 0.05  # seconds of stall a new choice must save over the one kept, at the least...
_SHARE = 0.05  # ...and this share of the stalls measured: less is noise, and a change costs reads...
_HOLD = 2.0  # ...and it must remove this many times the stall the groups kept removed (a disk that
# reads every group alike saves the same per byte kept, whichever group it is)


class _Kept:
    """What the host tier keeps of the groups a :class:`FileReader` reads: whole groups' buffers,
    split groups' first bytes; chosen again by the stalls the first forward measured.

    Args:
        sizes: each group's bytes as kept, by name, in model order.
        host: the bytes of each the plan keeps (by name).
        account: the host budget they are held in (by ``owner``).
        owner: whom ``account`` counts them for.
        whole_only: the groups converted as they are read (kept whole or not at all).
    """

    def __init__(self, sizes: dict[str, int], host: dict[str, int], account: HostAccount, owner: object,
                 whole_only: set[str]) -> None:
        self.sizes, self.account, self.owner, self.whole_only = sizes, account, owner, whole_only
        self.keep: dict[str, int] = {}  # bytes kept (or to keep once read) by name
        for name, nbytes in sizes.items():
            wanted = min(host.get(name, 0), nbytes)
            if name in whole_only and wanted < nbytes:
                continue
            if wanted and account.reserve(owner, wanted):
                self.keep[name] = wanted
        self.whole: dict[str, torch.Tensor] = {}  # kept groups' buffers
        self.parts: dict[str, tuple[torch.Tensor, list[_Segment], list[_Piece]]] = {}  # split groups': kept bytes, where they go, the rest's reads
        self.stalls: dict[str, float] | None = {}  # measured in the first forward, then None
        self.nbytes = 0  # kept now

    def is_whole(self, name: str) -> bool:
        """Whether the host keeps all of group ``name``."""
        return self.keep.get(name, 0) >= self.sizes[name]

    def store(self, name: str, read: _Read, group: Any, pieces: list[_Piece], allocate: Callable[[int], torch.Tensor]) -> None:
        """Keep what the tier keeps of group ``name``, just read (into a buffer of its own where it
        was kept whole when the read started, else a lent one); ``allocate`` makes host buffers."""
        kept, buffer = self.keep.get(name, 0), read.buffer
        if not kept or name in self.whole or name in self.parts:
            return
        if kept >= self.sizes[name]:
            if not read.keep:  # read ahead before the tier chose it: a buffer of its own
                buffer = _aligned(group.layout.nbytes, allocate).copy_(buffer[: group.layout.nbytes])
            self.whole[name] = buffer
        else:
            segments, rest = _split(pieces, kept)
            part = _normal_tensors(lambda n: torch.empty(n, dtype=torch.uint8))(kept)  # read by the reading threads
            for seg in segments:
                part[seg.at : seg.at + seg.nbytes].copy_(buffer[seg.offset : seg.offset + seg.nbytes])
            self.parts[name] = (part, segments, rest)
        self.nbytes += kept

    def drop(self, name: str) -> None:
        """Keep nothing of group ``name`` from now on; its bytes go back to the budget."""
        if self.whole.pop(name, None) is not None or self.parts.pop(name, None) is not None:
            self.nbytes -= self.keep[name]
        held = self.keep.pop(name, 0)
        if held:
            self.account.give(self.owner, held)

    def stalled(self, name: str, seconds: float) -> None:
        """The forward waited ``seconds`` for group ``name``'s bytes (counted in the first forward)."""
        if self.stalls is not None:
            self.stalls[name] = self.stalls.get(name, 0.0) + seconds

    def choose(self) -> dict[str, int] | None:
        """After the first forward: keep the groups whose reads kept it waiting longest per byte,
        where that saves clearly more stall than the groups kept now (:data:`_GAIN`, :data:`_SHARE`);
        what is kept now, or ``None`` where nothing changed."""
        stalls, self.stalls = self.stalls, None
        if not stalls:
            return None
        order = {name: i for i, name in enumerate(self.sizes)}
        ranked = sorted(self.sizes, key=lambda n: (-stalls.get(n, 0.0) / max(1, self.sizes[n]), order[n]))
        room = self.account.held(self.owner) + self.account.free_bytes()
        chosen = fill([(name, self.sizes[name]) for name in ranked], room, self.whole_only)

        def saved(kept: dict[str, int]) -> float:  # the stall a choice removes (a split group's in proportion)
            return sum(stalls.get(n, 0.0) * b / max(1, self.sizes[n]) for n, b in kept.items())

        now = saved(self.keep)
        if saved(chosen) - now < max(_GAIN, _SHARE * sum(stalls.values()), (_HOLD - 1) * now):
            return None
        for name in [n for n in self.keep if chosen.get(n) != self.keep[n]]:
            self.drop(name)
        self.account.release(self.owner)
        self.keep = chosen if self.account.reserve(self.owner, sum(chosen.values())) else {}
        return dict(self.keep)

    def release(self) -> None:
        """Keep nothing; give the budget back."""
        self.whole.clear()
        self.parts.clear()
        self.keep.clear()
        self.nbytes = 0
        self.account.release(self.owner)


class FileReader:
    """Reads the groups streamed from a checkpoint file, ahead of use; keeps the host tier's.

    Args:
        groups: the packed groups read from the file, in model order.
        host: the bytes of each the host keeps once read, by name (within ``account``).
        account: the host budget the kept groups are held in.
        device: the offload's device (where it copies from: pinned buffers when it can).
        order: the execution order recorded by the offload (read-ahead follows it).
        stats: where the bytes read per forward and the host bytes kept are reported.
        buffers: read buffers (each as large as the largest group not kept).

    Example:
        >>> import os, tempfile
        >>> import torch
        >>> from torch import nn
        >>> from safetensors.torch import save_file
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> save_file(model.state_dict(), path)
        >>> expected = model(torch.ones(1, 4)).detach()
        >>> handle = torchsurgery.offload(model, storage=path, groups="leaves", host_budget=80)
        >>> [g.tier for g in handle.plan.groups]
        ['host', 'disk']
        >>> with torch.no_grad():
        ...     out = [model(torch.ones(1, 4)) for _ in range(2)]
        >>> torch.equal(out[1], expected), handle.stats().storage_bytes_read  # the second group's 80 bytes
        (True, 80)
        >>> _ = handle.remove()
    """

    def __init__(self, groups: list[Any], host: dict[str, int], account: HostAccount, device: OffloadDevice,
                 order: OrderRecorder, stats: OffloadStats, buffers: int,
                 chosen: Callable[[dict[str, int]], None] | None = None) -> None:
        planned = {g.name: (g, _pieces(g)) for g in groups}
        self._groups = {name: (g, p) for name, (g, p) in planned.items() if p is not None}
        self._names = list(self._groups)
        converting = {n for n, (g, _) in self._groups.items() if g.conversion is not None}
        self._kept = _Kept({n: self._bytes(n) for n in self._names}, host, account, self, converting)
        self._device, self._order, self._stats, self._chosen = device, order, stats, chosen
        self._size = self._largest_read()
        self._buffers = max(1, buffers)
        pinned = device.can_pin and not device.host_compute
        self._allocate = _normal_tensors(device.pinned_empty if pinned else lambda n: torch.empty(n, dtype=torch.uint8))
        try:
            paths = {piece.path for _, pieces in self._groups.values() for piece in pieces or ()}
            # direct reads where the files hold more than the host keeps
            self._files = _Files(paths, direct=not all(self._kept.is_whole(n) for n in self._names))
        except BaseException:
            self._kept.release()
            raise
        self._pool = concurrent.futures.ThreadPoolExecutor(_THREADS, thread_name_prefix="torchsurgery-read")
        self._local = threading.local()  # each thread's bounce buffer for direct reads
        self._stop = threading.Event()
        self._free: list[tuple[torch.Tensor, Any]] = []  # read buffers and the copy that last read each
        self._made = 0
        self._lent: dict[int, torch.Tensor] = {}  # read buffers handed out, by address
        self._flight: dict[str, _Read] = {}
        self._read_now = 0  # bytes read from the files for the groups of this forward
        self.closed = False

    @property
    def direct(self) -> bool:
        """Whether some file is read past the page cache."""
        return self._files.direct

    def reading(self) -> list[str]:
        """The groups whose reads were started ahead of use and not taken yet."""
        return list(self._flight)

    def serves(self, group: Any) -> bool:
        """Whether ``group``'s reads go through this reader."""
        return not self.closed and group.name in self._groups

    def ready(self, group: Any) -> bool:
        """Whether ``group``'s bytes are in memory now (kept, or read ahead and landed)."""
        read = self._flight.get(group.name)
        if read is None:
            return group.name in self._kept.whole
        return all(f.done() for f in read.futures)

    def take(self, group: Any) -> torch.Tensor:
        """``group``'s bytes in its layout (a ``uint8`` host buffer; waits for its read), reading ahead.

        A read buffer is lent until :meth:`give_back`; a kept group's buffer is the host tier's.

        Raises:
            OSError: the read failed (the message names the file).
            torchsurgery.CheckpointError: the file ended before the group's bytes.
        """
        name = group.name
        read = self._flight.pop(name, None)
        if read is None and name in self._kept.whole:
            data = self._kept.whole[name]
        else:
            waiting = _clock()
            try:
                data = self._finish(read if read is not None else self._start(name))
            except (OSError, CheckpointError):
                if read is None:
                    raise
                data = self._finish(self._start(name))  # read ahead, maybe before the cause was fixed: once more
            self._kept.stalled(name, _clock() - waiting)
        self._ahead(name)
        return data[: group.layout.nbytes]

    def _bytes(self, name: str) -> int:
        """The bytes of group ``name``'s weights as it keeps them (what the host tier counts of it)."""
        return _kept_bytes(self._groups[name][0])

    def _largest_read(self) -> int:
        """The bytes of the largest group not kept whole (a read buffer's)."""
        return max((_read_bytes(g) for n, (g, _) in self._groups.items() if not self._kept.is_whole(n)), default=0)

    def give_back(self, data: torch.Tensor, copied: Any = None) -> None:
        """Return a buffer :meth:`take` lent, once ``copied`` (an event of the copy reading it) completed."""
        buffer = self._lent.pop(data.data_ptr(), None)
        if buffer is not None:
            self._free.append((buffer, copied))

    def end_forward(self) -> None:
        """A forward ended: its bytes read become the statistics' ``storage_bytes_read``."""
        self._stats.storage_bytes_read = self._read_now
        self._read_now = 0
        chosen = self._kept.choose()  # after the first forward: by its stalls
        if chosen is not None:
            self._size = max(self._size, self._largest_read())  # smaller free buffers go (_buffer)
            if self._chosen is not None:
                self._chosen(chosen)

    def forget(self, name: str) -> None:
        """Group ``name`` no longer streams (it became resident): its read and kept bytes go."""
        read = self._flight.pop(name, None)
        if read is not None:
            concurrent.futures.wait(read.futures)
            self._recycle(read)
        self._kept.drop(name)
        self._kept.sizes.pop(name, None)
        self._groups.pop(name, None)
        self._names.remove(name)

    def close(self) -> None:
        """Stop the reads not started, wait for the others, free every buffer and the host budget held."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        for read in self._flight.values():
            concurrent.futures.wait(read.futures)
        self._pool.shutdown(wait=True)
        self._files.close()
        self._flight.clear()
        self._kept.release()
        self._free.clear()
        self._lent.clear()

    def _start(self, name: str) -> _Read:
        group, pieces = self._groups[name]
        keep = self._kept.is_whole(name)
        buffer = _aligned(group.layout.nbytes, self._allocate) if keep else self._buffer()
        if not keep:
            self._lent[buffer.data_ptr()] = buffer
        started = _checkpoint.read_clock()
        part = self._kept.parts.get(name)
        reads = part[2] if part is not None else pieces or []
        raw = _raw(group, buffer)  # where the file's bytes go: the buffer, or one they are converted from
        futures = [self._pool.submit(self._read_piece, name, raw, piece) for piece in reads]
        if part is not None:  # a split group (never one converted as read): its first bytes from what the host keeps
            futures.append(self._pool.submit(_fill, raw, part[0], part[1]))
        self._flight[name] = read = _Read(name, buffer, futures, keep, started, nbytes=_file_bytes(reads), raw=raw)
        return read

    def _buffer(self) -> torch.Tensor:
        """A free read buffer: reused, new while fewer than ``buffers`` exist, else one read ahead for
        a group not asked for yet is dropped for it (the order changed)."""
        while self._free:
            buffer, copied = self._free.pop()
            if copied is not None:
                self._device.synchronize(copied)  # the copy that read it has landed
            if buffer.numel() >= self._size:
                return buffer
            self._made -= 1  # made before a larger group came to be read (the host tier chose again)
        victim = next((r for r in self._flight.values() if not r.keep), None)
        if self._made < self._buffers or victim is None:
            self._made += 1
            return _aligned(self._size, self._allocate)
        del self._flight[victim.name]
        concurrent.futures.wait(victim.futures)
        del self._lent[victim.buffer.data_ptr()]
        return victim.buffer if victim.buffer.numel() >= self._size else _aligned(self._size, self._allocate)

    def _finish(self, read: _Read) -> torch.Tensor:
        self._flight.pop(read.name, None)
        concurrent.futures.wait(read.futures)
        for future in read.futures:
            error = future.exception()
            if error is not None:
                self._recycle(read)
                if isinstance(error, CheckpointError):  # cut short: where the file changed, say how
                    _unchanged(*self._groups[read.name])
                raise error
        _landed(*self._groups[read.name], read, self._recycle)
        self._read_now += read.nbytes
        self._kept.store(read.name, read, *self._groups[read.name], self._allocate)
        self._stats.peak_host_bytes = max(self._stats.peak_host_bytes, self._kept.nbytes)
        return read.buffer

    def _recycle(self, read: _Read) -> None:
        if not read.keep:  # a read not handed out: its buffer back to the free ones
            self.give_back(read.buffer)

    def _ahead(self, name: str) -> None:
        """Start the reads of the groups that follow ``name``, in order, across the end of the forward."""
        recorded = self._order.recorded
        if recorded:
            following = self._order.ahead(name, len(recorded)) + recorded
        else:  # the first forward: model order
            at = self._names.index(name) + 1 if name in self._names else 0
            following = self._names[at:] + self._names
        in_flight = len(self._flight)
        for upcoming in dict.fromkeys(following):
            if in_flight >= self._buffers:
                break
            if upcoming == name or upcoming not in self._groups or upcoming in self._flight or upcoming in self._kept.whole:
                continue
            if not self._kept.is_whole(upcoming) and not self._free and self._made >= self._buffers:
                break  # no read buffer free: the next one starts when one is given back
            self._start(upcoming)
            in_flight += 1

    def _read_piece(self, name: str, buffer: torch.Tensor, piece: _Piece) -> None:
        if not self._stop.is_set():
            _read_piece(self._files, self._local, name, buffer, piece)


def _bounce(local: threading.local) -> torch.Tensor:
    """This thread's aligned buffer for direct reads (a piece and its alignment)."""
    bounce = getattr(local, "bounce", None)
    if bounce is None:
        bounce = local.bounce = _aligned(_BOUNCE, lambda n: torch.empty(n, dtype=torch.uint8))
    return bounce


def _read_piece(files: _Files, local: threading.local, name: str, buffer: torch.Tensor, piece: _Piece) -> None:
    """``piece`` of group ``name`` into ``buffer``: direct where the file is so opened (through the
    page cache from then on where its filesystem refuses), errors naming the file."""
    fd, direct = files.fd(piece.path)
    try:
        if direct:
            try:
                _read_direct(fd, buffer, piece, _bounce(local))
                return
            except OSError as exc:
                if exc.errno not in _REFUSED:
                    raise
                files.refuse_direct(piece.path)
                fd, _ = files.fd(piece.path)
        _read_buffered(fd, buffer, piece)
    except OSError as exc:
        raise OSError(
            exc.errno, f"torchsurgery.offload: reading group {name!r} from {piece.path} failed "
            f"({exc.strerror or exc}); check the file and its disk, then run the forward again",
        ) from exc
    except CheckpointError as exc:
        raise CheckpointError(f"{exc} (reading group {name!r})") from exc


def _landed(group: Any, pieces: list[_Piece] | None, read: _Read, recycle: Callable[[_Read], None]) -> None:
    """Count ``read`` of ``group`` in its source's reads (their speed); refuse it (its buffer to
    ``recycle``) where a file changed since the offload opened it (truncated, written in place,
    deleted or replaced: its source's check); then, where the group keeps another format than
    the file's, convert what was read into its buffer
    (:meth:`~torchsurgery.offloading.file_format.FileConversion.convert`)."""
    source = group.source
    source.bytes_read += read.nbytes
    source.seconds_reading += max(0.0, _checkpoint.read_clock() - read.started)
    try:
        _unchanged(group, pieces)
    except CheckpointError:
        recycle(read)
        raise
    if group.conversion is not None and read.raw is not None:
        group.conversion.convert(read.raw, read.buffer, group.layout)
        read.raw = None


def _file_bytes(pieces: list[_Piece] | None) -> int:
    """The bytes a group's reads take from the files."""
    return sum(p.end - p.start for p in pieces or ())


def _kept_bytes(group: Any) -> int:
    """The bytes of ``group``'s weights as it keeps them: the file's where it converts none, else
    those of the storage format (a scaled weight's scale included)."""
    return sum(slot.nbytes for slot in group.layout.slots)


def _raw(group: Any, buffer: torch.Tensor) -> torch.Tensor:
    """Where a read of ``group`` puts the file's bytes: ``buffer`` (a read buffer has room for them,
    and a group converted as it is read is converted there in place), or, for a kept group whose
    buffer is smaller, a buffer of the file's layout for this read only (a normal tensor also under
    ``torch.inference_mode``)."""
    if group.conversion is None or buffer.numel() >= group.file_layout.nbytes:
        return buffer
    with torch.inference_mode(False):
        return torch.empty(group.file_layout.nbytes, dtype=torch.uint8)


def _read_bytes(group: Any) -> int:
    """The bytes a read buffer needs for ``group``: its layout's, or the file's where they are more
    (a group converted as it is read lands there as the file stores it)."""
    return max(group.layout.nbytes, group.file_layout.nbytes)


def _unchanged(group: Any, pieces: list[_Piece] | None) -> None:
    group.source.check_unchanged({piece.path for piece in pieces or ()})


def _read_buffered(fd: int, buffer: torch.Tensor, piece: _Piece) -> None:
    """``piece`` through the page cache, straight into the tensors' places in ``buffer``."""
    memory = buffer.numpy().data
    views = [memory[s.offset + max(piece.start, s.start) - s.start : s.offset + min(piece.end, s.end) - s.start]
             for s in piece.spans]
    ended = _checkpoint.transfer(os.preadv, fd, views, piece.start)
    if ended is not None:
        _ends_early(piece, ended[0])


def _read_direct(fd: int, buffer: torch.Tensor, piece: _Piece, bounce: torch.Tensor) -> None:
    """``piece`` past the page cache: its aligned range into ``bounce``, then each tensor's bytes to its place."""
    lo = piece.start - piece.start % _ALIGN
    size = -(-(piece.end - lo) // _ALIGN) * _ALIGN
    memory = bounce.numpy().data
    got = 0
    while got < piece.end - lo:  # reads past the file's end come short: only the tensors' bytes must be there
        done = os.preadv(fd, [memory[got:size]], lo + got)
        if done == 0:
            _ends_early(piece, lo + got)
        got += done
    for s in piece.spans:  # trimmed to the tensors' bytes
        first, last = max(piece.start, s.start), min(piece.end, s.end)
        buffer[s.offset + first - s.start : s.offset + last - s.start].copy_(bounce[first - lo : last - lo])


def _ends_early(piece: _Piece, at: int) -> None:
    raise CheckpointError(
        f"{piece.path}: ends at byte {at}, before the weights it held at bytes {piece.start}-{piece.end} "
        "(was it truncated or rewritten after the offload opened it?); save the checkpoint again and offload from it"
    )
