"""Reading checkpoints without trusting them: header first, then bytes in bulk or mapped.

Sources are opened lazily: first every name, shape and dtype is known (so a load can be
checked completely before anything is written), then tensors are either read or mapped.

* :meth:`Source.read_many` fills given tensors. safetensors bytes go straight into the
  tensors with ``os.preadv``: tensors that lie next to each other in the file are read in
  one system call (up to ``_CHUNK`` bytes and ``_IOV_MAX`` tensors per call), and large
  loads spread their calls over threads, half the cores (the kernel's copy runs without
  the GIL), which is how several shards are read at once. The call returns only when no thread is
  writing any more, also when it fails or is interrupted.
* :meth:`Source.mapped` gives a tensor backed by the file itself: a private
  (copy-on-write) memory map, so nothing is read until a page is first used, the pages
  are the page cache's (not the process's own memory), and a write goes to a private
  copy of its page, never to the file.

The safetensors header is validated in full (sizes, dtypes, offsets inside the file, no
overlaps, UTF-8 names) before any tensor is read or mapped; the mapping is made from the
same open file whose header was checked. ``.pt``/``.bin`` files go through
``torch.load(weights_only=True, mmap=True)``, so no arbitrary object is ever unpickled.
"""

from __future__ import annotations

import abc
import concurrent.futures
import json
import math
import mmap
import os
import struct
import tempfile
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchsurgery._swap import copy_of
from torchsurgery._validate import dtype_from_safetensors

_MAX_HEADER = 100 * 1024 * 1024
_CHUNK = 64 * 1024 * 1024  # the most bytes one read system call asks for
_IOV_MAX = 1024  # the most buffers one preadv call fills (Linux's limit)
_PARALLEL_BYTES = 64 * 1024 * 1024  # smaller reads are not worth a thread
# reading threads: half the cores, at most 4; on 2 cores a second thread made loads slower
_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
_clock = time.perf_counter  # times the reads (the tests give another clock)


def read_clock() -> float:
    """Seconds by the clock checkpoint reads are timed with (the slow-filesystem hint)."""
    return _clock()


class CheckpointError(ValueError):
    """A checkpoint that cannot be read safely: truncated, corrupt, crafted or unsafe.

    Example:
        >>> import torchsurgery
        >>> issubclass(torchsurgery.CheckpointError, ValueError)
        True
    """


@dataclass(frozen=True)
class Entry:
    """Name-independent facts about one stored tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class Source(abc.ABC):
    """A checkpoint opened for reading: :meth:`entries` first, then tensors read or mapped."""

    @abc.abstractmethod
    def entries(self) -> dict[str, Entry]:
        """Every stored tensor's name, shape and dtype, without reading any data."""

    @abc.abstractmethod
    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor stored under ``key``, in memory of its own or written into ``out`` (cast if needed)."""

    @abc.abstractmethod
    def take(self, keys: list[str], *, copy: bool) -> list[torch.Tensor]:
        """The tensors stored under ``keys``; in memory of their own when ``copy`` (else maybe shared)."""

    def read_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Write the tensor stored under each key into its tensor (same shape; cast if needed).

        When it raises (or is interrupted), nothing is writing into the tensors any more,
        but some of them may hold part of the new values.
        """
        for key, out in items:
            self.read(key, out=out)

    @abc.abstractmethod
    def mapped(self, key: str) -> torch.Tensor | None:
        """The tensor stored under ``key`` without a copy, or ``None`` where that is not possible."""

    def close(self) -> None:  # noqa: B027 - sources without files have nothing to release
        """Release open files (mapped tensors stay valid)."""


class DictSource(Source):
    """A state dict already in memory (or memory-mapped by ``torch.load(mmap=True)``)."""

    def __init__(self, state: Mapping[str, Any], what: str) -> None:
        bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(
                f"{what}: a state dict maps names (str) to tensors; these entries are not: {bad[:5]}"
            )
        self._state = state

    def entries(self) -> dict[str, Entry]:
        return {k: Entry(tuple(v.shape), v.dtype) for k, v in self._state.items()}

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        value: torch.Tensor = self._state[key]
        if out is not None:
            out.copy_(value)
            return out
        return value

    def take(self, keys: list[str], *, copy: bool) -> list[torch.Tensor]:
        return [self._state[key].clone() if copy else self._state[key] for key in keys]

    def mapped(self, key: str) -> torch.Tensor:
        return self._state[key]


@dataclass(frozen=True)
class _Located:
    path: Path
    entry: Entry
    start: int  # absolute byte offset in the file
    nbytes: int


def _parse_header(path: Path, f: BinaryIO) -> dict[str, _Located]:
    # our own parse: preadv needs each tensor's byte offset, which safe_open does not expose
    size = os.fstat(f.fileno()).st_size
    raw = f.read(8)
    if len(raw) < 8:
        raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes; truncated?)")
    (header_len,) = struct.unpack("<Q", raw)
    if header_len > min(_MAX_HEADER, size - 8):
        raise CheckpointError(
            f"{path}: the header claims {header_len} bytes but the file has {size}; truncated or not safetensors"
        )
    try:
        header = json.loads(f.read(header_len).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: the safetensors header is not valid UTF-8 JSON ({exc})") from exc
    except RecursionError as exc:  # crafted: a header nested deeper than Python's parser goes
        raise CheckpointError(f"{path}: the safetensors header is nested too deeply to be one") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    data_start = 8 + header_len
    data_len = size - data_start
    located: dict[str, _Located] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise CheckpointError(f"{path}: entry {name!r} is not an object")
        dtype = dtype_from_safetensors(str(info.get("dtype")))
        if dtype is None:
            raise CheckpointError(f"{path}: entry {name!r} has unknown dtype {info.get('dtype')!r}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise CheckpointError(f"{path}: entry {name!r} has invalid shape {shape!r}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise CheckpointError(
                f"{path}: entry {name!r} has offsets {offsets!r} outside the {data_len} data bytes "
                "(truncated or corrupt file)"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise CheckpointError(
                f"{path}: entry {name!r} declares {offsets[1] - offsets[0]} bytes for shape {shape} "
                f"of {dtype}, which needs {nbytes}"
            )
        spans.append((offsets[0], offsets[1], name))
        located[name] = _Located(path, Entry(tuple(shape), dtype), data_start + offsets[0], nbytes)
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise CheckpointError(f"{path}: entries {first!r} and {second!r} overlap")
    return located


@dataclass(frozen=True)
class _Stamp:
    """What identifies a file's contents cheaply: its size, modification time and inode."""

    size: int
    mtime_ns: int
    device: int
    inode: int

    @classmethod
    def of(cls, st: os.stat_result) -> _Stamp:
        return cls(st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino)


def _changed(change: str) -> str:
    """What to say of a file that changed since it was opened (``change``: how), with the fix."""
    return (
        f"changed since it was opened for reading: {change}. What is read from it no longer matches what was "
        "checked when it was opened; open it again as it is now (for an offload: remove() it, then offload again "
        "from the new file)"
    )


def _change(path: Path, opened: _Stamp, fd: int) -> str | None:
    """How the file opened as ``fd`` (stamped ``opened``) or its ``path`` changed since; ``None``: unchanged."""
    now = _Stamp.of(os.fstat(fd))
    if now.size != opened.size:
        return f"its size went from {opened.size} to {now.size} bytes (truncated or rewritten in place)"
    if now.mtime_ns != opened.mtime_ns:
        return "it was written to in place (its modification time changed)"
    try:
        named = _Stamp.of(os.stat(path))
    except FileNotFoundError:
        return "it was deleted (the open file still holds the original bytes)"
    if (named.device, named.inode) != (opened.device, opened.inode):
        return "another file was put in its place (the open file still holds the original bytes)"
    return None


def _is_raw(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds exactly its values, in order (so its bytes can be read or written)."""
    return (
        t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()
        and not is_traceable_wrapper_subclass(t)  # e.g. an offloaded weight: its values are elsewhere
    )


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a raw CPU tensor (see :func:`_is_raw`), writable in place (0-dim tensors too)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy().data


@dataclass
class _Batch:
    """File-adjacent byte ranges that one ``preadv`` call fills."""

    path: Path
    offset: int
    keys: list[str]
    views: list[memoryview]


def _batches(spans: list[tuple[str, _Located, memoryview]]) -> list[_Batch]:
    """``spans`` grouped into system calls of at most ``_CHUNK`` bytes and ``_IOV_MAX`` buffers."""
    batches: list[_Batch] = []
    current: _Batch | None = None
    end = size = 0
    for key, loc, view in sorted(spans, key=lambda s: (s[1].path, s[1].start)):
        position = loc.start
        while view.nbytes:  # a tensor larger than a chunk is read by several calls
            if current is None or current.path != loc.path or position != end or size >= _CHUNK or len(current.views) >= _IOV_MAX:
                current = _Batch(loc.path, position, [], [])
                batches.append(current)
                end, size = position, 0
            piece = view[: _CHUNK - size]
            current.keys.append(key)
            current.views.append(piece)
            size += piece.nbytes
            end += piece.nbytes
            position += piece.nbytes
            view = view[piece.nbytes :]
    return batches


def transfer(call: Any, fd: int, views: list[memoryview], offset: int) -> tuple[int, int] | None:
    """Run ``os.preadv``/``os.pwritev`` until ``views`` are done; else (end offset, views left) at EOF.

    Example:
        >>> import os, tempfile
        >>> fd, path = tempfile.mkstemp()
        >>> transfer(os.pwritev, fd, [memoryview(b"abc"), memoryview(b"de")], 0) is None
        True
        >>> into = bytearray(4)
        >>> transfer(os.preadv, fd, [memoryview(into)], 2), bytes(into[:3])  # the file ends at byte 5
        ((5, 1), b'cde')
        >>> os.close(fd); os.remove(path)
    """
    views = list(views)
    while views:
        done = call(fd, views, offset)
        if done == 0:
            return offset, len(views)
        offset += done
        while views and done >= views[0].nbytes:
            done -= views[0].nbytes
            del views[0]
        if done:
            views[0] = views[0][done:]
    return None


def _anonymous_file() -> int:
    """A file descriptor of a file without a name, in memory where the system allows."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("torchsurgery-stash")
    fd, name = tempfile.mkstemp()
    os.unlink(name)
    return fd


class Stash:
    """The bytes of some tensors kept aside, to be put back if what follows fails.

    CPU tensors go to an anonymous in-memory file (``memfd``): one system call moves many
    tensors, and the kernel allocates its pages far faster than a process faults in the
    pages of new tensors. The file takes as much memory as those tensors (as shared
    memory, outside the process's resident size) until :meth:`close`, or for as long as
    the tensors :meth:`keep` returns live. Other tensors (on a GPU, or not contiguous) are
    copied to host memory.

    Example:
        >>> import torch
        >>> t = torch.arange(4.0)
        >>> stash = Stash([t])
        >>> _ = t.zero_()
        >>> stash.restore(); stash.close()
        >>> t
        tensor([0., 1., 2., 3.])
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = list(tensors)
        in_file = [t for t in tensors if _is_raw(t) and t.numel()]
        self._in_file = [_bytes_of(t) for t in in_file]
        self._fd = _anonymous_file() if self._in_file else -1
        try:
            with torch.no_grad():
                kept = set(map(id, in_file))
                self._clones = {
                    id(t): (t, copy_of(t) if t.device.type == "cpu" else t.detach().to("cpu", copy=True))
                    for t in tensors if id(t) not in kept
                }
            for i in range(0, len(self._in_file), _IOV_MAX):
                offset = sum(v.nbytes for v in self._in_file[:i])
                if transfer(os.pwritev, self._fd, self._in_file[i : i + _IOV_MAX], offset) is not None:
                    raise OSError(f"could not keep {len(self._in_file)} tensors aside in memory")
        except BaseException:
            if self._fd >= 0:
                os.close(self._fd)
            raise

    def restore(self) -> None:
        """Write the kept bytes back into their tensors."""
        offset = 0
        for i in range(0, len(self._in_file), _IOV_MAX):
            views = self._in_file[i : i + _IOV_MAX]
            if transfer(os.preadv, self._fd, views, offset) is not None:
                raise OSError("the tensors kept aside could not be read back")
            offset += sum(v.nbytes for v in views)
        with torch.no_grad():
            for t, old in self._clones.values():
                t.detach().copy_(old)

    def keep(self) -> list[torch.Tensor]:
        """The kept values as CPU tensors, one per tensor given.

        Values from the in-memory file are views of a mapping of it (nothing is copied,
        unless the file cannot be mapped); its memory is freed when the last of them is.
        """
        size = sum(v.nbytes for v in self._in_file)
        base = torch.empty(0, dtype=torch.uint8)
        if size:
            try:
                base = torch.frombuffer(mmap.mmap(self._fd, size), dtype=torch.uint8)
            except OSError:  # no room for a mapping: read the bytes into memory of their own
                base = torch.empty(size, dtype=torch.uint8)
                if transfer(os.preadv, self._fd, [_bytes_of(base)], 0) is not None:
                    raise OSError("the tensors kept aside could not be read back") from None
        values: list[torch.Tensor] = []
        offset = 0
        for t in self._tensors:
            if id(t) in self._clones:
                values.append(self._clones[id(t)][1])
                continue
            nbytes = t.numel() * t.element_size()
            piece = base[offset : offset + nbytes]
            # a view as another dtype must start at a multiple of its size
            values.append((piece.clone() if offset % t.element_size() else piece).view(t.dtype).reshape(t.shape))
            offset += nbytes
        return values

    def close(self) -> None:
        """Free the kept bytes (in the background: the kernel takes a while to free many pages)."""
        if self._fd >= 0:
            threading.Thread(target=os.close, args=(self._fd,), name="torchsurgery-stash-free", daemon=True).start()
            self._fd = -1
        self._clones = {}


class SafetensorsSource(Source):
    """One safetensors file, or the shards listed by a ``*.index.json``.

    Each file's size, modification time and inode are recorded when it is opened; every
    read checks them afterwards (one ``fstat`` and one ``stat`` per file read), so that
    values read from a file changed in place since (truncated, rewritten) are refused
    rather than used, and a file deleted or replaced is reported, though what is read
    comes from the original, which the open file keeps.

    Attributes:
        bytes_read: bytes read by :meth:`read_many` so far.
        seconds_reading: the wall time those reads took (their system calls, all threads).
    """

    def __init__(self, paths: list[Path]) -> None:
        self._files: dict[Path, BinaryIO] = {}
        self._maps: dict[Path, torch.Tensor] = {}  # each file's bytes, mapped on first use
        self._where: dict[str, _Located] = {}
        self._stamps: dict[Path, _Stamp] = {}
        self.bytes_read = 0
        self.seconds_reading = 0.0
        try:
            for path in paths:
                f = open(path, "rb")  # noqa: SIM115 - kept open until close()
                self._files[path] = f
                self._stamps[path] = _Stamp.of(os.fstat(f.fileno()))
                for name, loc in _parse_header(path, f).items():
                    if name in self._where:
                        raise CheckpointError(f"{path}: {name!r} is also stored in {self._where[name].path}")
                    self._where[name] = loc
        except BaseException:
            self.close()
            raise

    def __getstate__(self) -> dict[str, Any]:
        # a copy of a model streamed from the file (pickle, deepcopy, torch.save) opens the
        # files again; what their headers said is kept, so a file changed since is noticed
        # when a read comes short
        return {"paths": list(self._files), "where": self._where, "stamps": self._stamps}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._files = {}
        self._maps = {}
        self._where = state["where"]
        self._stamps = state["stamps"]
        self.bytes_read = 0
        self.seconds_reading = 0.0
        try:
            for path in state["paths"]:
                self._files[path] = open(path, "rb")  # noqa: SIM115 - kept open until close()
        except BaseException:
            self.close()
            raise

    def entries(self) -> dict[str, Entry]:
        return {name: loc.entry for name, loc in self._where.items()}

    def read(self, key: str, out: torch.Tensor | None = None, *, check: bool = True) -> torch.Tensor:
        loc = self._where[key]
        target = out if out is not None else torch.empty(loc.entry.shape, dtype=loc.entry.dtype)
        self.read_many([(key, target)], check=check)
        return target

    def locate(self, key: str) -> tuple[Path, int, int, torch.dtype]:
        """Where ``key``'s bytes are: its file, their offset there, their count, and its dtype."""
        loc = self._where[key]
        return loc.path, loc.start, loc.nbytes, loc.entry.dtype

    def take(self, keys: list[str], *, copy: bool) -> list[torch.Tensor]:
        new = [torch.empty(self._where[key].entry.shape, dtype=self._where[key].entry.dtype) for key in keys]
        self.read_many(list(zip(keys, new, strict=True)))
        return new

    def read_many(self, items: Sequence[tuple[str, torch.Tensor]], *, check: bool = True) -> None:
        """:meth:`Source.read_many`; then, with ``check``, refuse what was read where a file changed since it
        was opened (:meth:`check_unchanged`)."""
        # preadv, not safe_open's map: a read that fails (an I/O error, a file cut short) raises, so the
        # load can put every tensor back, where a mapped page kills the process (SIGBUS); a map plus
        # copy_ is faster from the page cache (docs/benchmarks.md, benchmarks/checkpoint_read.py)
        spans: list[tuple[str, _Located, memoryview]] = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, its bytes as stored)
        for key, out in items:
            loc = self._where[key]
            target = out
            if not (_is_raw(out) and out.dtype == loc.entry.dtype):
                target = torch.empty(loc.entry.shape, dtype=loc.entry.dtype)
                staged.append((out, target))
            if loc.nbytes:
                spans.append((key, loc, _bytes_of(target)))
        batches = _batches(spans)
        start = _clock()
        if len(batches) < 2 or _THREADS < 2 or sum(loc.nbytes for _, loc, _ in spans) < _PARALLEL_BYTES:
            for batch in batches:
                self._fill(batch)
        else:
            self._fill_in_parallel(batches)
        self.seconds_reading += _clock() - start
        self.bytes_read += sum(loc.nbytes for _, loc, _ in spans)
        if check:
            self.check_unchanged({loc.path for _, loc, _ in spans})
        with torch.no_grad():
            for out, target in staged:
                out.copy_(target)

    def check_unchanged(self, paths: Collection[Path]) -> None:
        """Raise a :class:`CheckpointError` naming the first of ``paths`` that changed since it was opened."""
        for path in sorted(paths):
            change = self._change(path)
            if change is not None:
                raise CheckpointError(f"{path}: {_changed(change)}")

    def _change(self, path: Path) -> str | None:
        return _change(path, self._stamps[path], self._files[path].fileno())

    def _fill_in_parallel(self, batches: list[_Batch]) -> None:
        stop = threading.Event()

        def work(batch: _Batch) -> None:
            if not stop.is_set():
                self._fill(batch)

        with concurrent.futures.ThreadPoolExecutor(min(_THREADS, len(batches))) as pool:
            futures = [pool.submit(work, batch) for batch in batches]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                # a failure or an interrupt: let no thread go on writing once we return
                stop.set()
                concurrent.futures.wait(futures)
                raise

    def _fill(self, batch: _Batch) -> None:
        try:
            left = transfer(os.preadv, self._files[batch.path].fileno(), batch.views, batch.offset)
        except OSError as exc:  # the disk, the network filesystem, a file taken away underneath
            change = self._change(batch.path)  # an OSError still (errno kept), its message naming what failed
            raise OSError(
                exc.errno, f"{batch.path}: reading {batch.keys[0]!r} failed ({exc.strerror or exc})"
                + (f"; {change}" if change else "; check the disk or filesystem it lies on, then run again")
            ) from exc
        if left is not None:
            key = batch.keys[len(batch.keys) - left[1]]
            change = self._change(batch.path)
            why = _changed(change) if change else "was it truncated or rewritten after its header was read?"
            raise CheckpointError(f"{batch.path}: {key!r} ends early (the file ends at byte {left[0]}); {why}")

    def mapped(self, key: str) -> torch.Tensor | None:
        loc = self._where[key]
        if loc.start % loc.entry.dtype.itemsize:
            return None  # not aligned for its dtype in the file: only a copy can hold it
        base = self._maps.get(loc.path)
        if base is None:
            try:
                # our map, not safe_open's: one map (one storage) per file, from the file whose header was
                # checked; safe_open gives each tensor a storage of its own and opens the path again
                # ACCESS_COPY is MAP_PRIVATE: writes land in private pages, never in the file
                view = mmap.mmap(self._files[loc.path].fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as exc:
                raise CheckpointError(
                    f"{loc.path}: cannot be memory-mapped ({exc}); load it with copy=True to read it instead"
                ) from exc
            base = torch.frombuffer(view, dtype=torch.uint8)
            self._maps[loc.path] = base
        if loc.start + loc.nbytes > base.numel():
            raise CheckpointError(
                f"{loc.path}: {key!r} ends early (the file has {base.numel()} bytes, fewer than its header "
                "declared; was it truncated after its header was read?)"
            )
        return base[loc.start : loc.start + loc.nbytes].view(loc.entry.dtype).reshape(loc.entry.shape)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._maps.clear()

    def __del__(self) -> None:
        # a copy of a model streamed from the files (whose offload is never removed) opened them again
        files = getattr(self, "_files", None)
        if files:
            self.close()


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# ComfyUI's "fp8 scaled" files, then the layers its quantisation ops load (a per-layer JSON marker)
_SCALE_KEYS, _INPUT_SCALE_KEYS = ("scale_weight", "weight_scale"), ("scale_input", "input_scale")
_FILE_MARKER, _LAYER_MARKER = "scaled_fp8", "comfy_quant"


@dataclass(frozen=True)
class ScaledKeys:
    """The entries of ComfyUI's scaled fp8 layouts in a checkpoint (all empty for other checkpoints).

    In those layouts a weight ``<prefix>.weight`` is stored in float8 and stands for the values
    ``weight.float() * scale``, its scale one fp32 number: ``<prefix>.scale_weight`` in the
    "fp8 scaled" files, with a file marker ``scaled_fp8``; ``<prefix>.weight_scale`` in the
    layers its quantisation ops load (``comfy/quant_ops.py``), each with a marker
    ``<prefix>.comfy_quant`` (JSON naming the format, ``float8_e4m3fn``). An input scale
    (``scale_input``, ``input_scale``: the activations' scale of fp8 matmuls) may come with a
    weight. Keys the module itself has are never taken as these; a layer of another format
    (int8 per row, block scales) is refused by its scale, which is not one fp32 number for a
    float8 weight.

    Attributes:
        scales: each scaled weight's key -> its scale's key.
        understood: the scale, input-scale and marker keys: read with their weights or not
            needed (weights only), so neither loaded as tensors nor unexpected.
        problems: one line per scale that cannot be read so (the key, what is wrong, the fix).
    """

    scales: dict[str, str]
    understood: frozenset[str]
    problems: list[str]


def scaled_keys(stored: Mapping[str, Entry], wanted: Collection[str]) -> ScaledKeys:
    """The scaled fp8 entries of a checkpoint holding ``stored``, for a module whose keys are ``wanted``.

    A scale or input scale is taken as one only where its weight is both stored and wanted
    (else it is as unexpected as any other key); a weight stored in float8 without a scale
    stays a plain float8 tensor (scale 1, as ComfyUI reads it).
    """
    scales: dict[str, str] = {}
    understood: set[str] = set()
    problems: list[str] = []
    for key, entry in stored.items():
        prefix, _, last = key.rpartition(".")
        if key in wanted or last not in (*_SCALE_KEYS, *_INPUT_SCALE_KEYS, _FILE_MARKER, _LAYER_MARKER):
            continue
        weight = f"{prefix}.weight" if prefix else "weight"
        if last != _FILE_MARKER and not (weight in stored and weight in wanted):
            continue
        understood.add(key)
        problem = _scale_problem(key, entry, weight, stored[weight]) if last in _SCALE_KEYS else None
        if problem is not None:
            problems.append(problem)
        elif last in _SCALE_KEYS:
            scales[weight] = key
    return ScaledKeys(scales, frozenset(understood), problems)


def _scale_problem(key: str, scale: Entry, weight_key: str, weight: Entry) -> str | None:
    """Why ``key`` cannot scale ``weight_key`` in ComfyUI's layout, with the fix; ``None`` where it can."""
    dequantise = f"or save the values it stands for ({weight_key} * {key}) without the scale"
    suffix = key.rpartition(".")[2]
    if weight.dtype not in _FP8:
        return (
            f"{key!r} scales {weight_key!r}, which the checkpoint holds in {weight.dtype}: a {suffix} "
            f"belongs to a float8_e4m3fn or float8_e5m2 weight (ComfyUI's scaled fp8 layouts; its int8 and "
            f"block-scaled formats are not read); save the weight's float8 values with it, {dequantise}"
        )
    if not scale.dtype.is_floating_point or scale.dtype.itemsize > 4 or scale.dtype in _FP8:
        return (
            f"{key!r} is stored in {scale.dtype}: a {suffix} is a float32 number (float16 and bfloat16 "
            f"are read exactly too); save it as float32, {dequantise}"
        )
    if scale.shape not in ((), (1,)):
        return (
            f"{key!r} has shape {list(scale.shape)}: ComfyUI's scaled fp8 layout keeps one scale per weight "
            f"(shape [] or [1]); save one scale per tensor, {dequantise}"
        )
    return None


def read_scaled(reader: Source, keys: Sequence[tuple[str, str]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each (weight key, scale key): the weight's float8 values as stored and its scale (fp32, 0-dim)."""
    taken = reader.take([key for pair in keys for key in pair], copy=True)
    return [(q, scale.float().reshape(())) for q, scale in zip(taken[::2], taken[1::2], strict=True)]


def _entry_of(folder: Path, name: object) -> Path | None:
    """The file ``name`` of ``folder`` (symlinks followed), or ``None`` where that would leave the folder.

    The file, once every link is followed, must lie in ``folder`` itself (so no absolute
    path, no ``..``, no subfolder, no link leading out), or, for a snapshot of the Hugging
    Face hub's cache (``<repo>/snapshots/<revision>/``, each file a link into
    ``<repo>/blobs/``), in that repository's ``blobs`` folder.
    """
    if not isinstance(name, str):
        return None
    target = (folder / name).resolve()
    homes = {folder.resolve()}
    if folder.resolve().parent.name == "snapshots":
        homes.add(folder.resolve().parent.parent / "blobs")
    return target if target.parent in homes else None


def _index_shards(index: Path) -> list[Path]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index}: not a valid sharded-checkpoint index ({exc})") from exc
    shards = []
    for name in files:
        shard = _entry_of(index.parent, name)
        if shard is None:  # a crafted index must not make us read elsewhere (an absolute path, .., a link out)
            raise CheckpointError(
                f"{index}: shard {name!r} is not a file next to the index (an absolute path, a '..' or a symbolic "
                "link leading out of its folder); only files in the index's folder are read: put the shard there"
            )
        if shard.exists() and not shard.is_file():
            raise CheckpointError(f"{index}: shard {name!r} is not a regular file (a pipe, socket or device)")
        if not shard.is_file():
            raise CheckpointError(f"{index}: shard {name!r} is missing")
        shards.append(shard)
    return shards


def open_source(source: Any, what: str) -> Source:
    """Open ``source`` (a state dict, a file or a directory) for reading.

    Raises:
        TypeError: ``source`` is of no supported kind.
        FileNotFoundError: the path does not exist.
        CheckpointError: the file is truncated, corrupt, crafted or unsafe to unpickle.
    """
    if isinstance(source, Mapping):
        return DictSource(source, what)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"{what}: source must be a state dict, a .safetensors file, a *.index.json, a .pt/.bin "
            f"file or a directory holding one; got {type(source).__name__}"
        )
    path = Path(source)
    if path.is_dir():
        for candidate in ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin"):
            if (path / candidate).is_file():
                if _entry_of(path, candidate) is None:
                    raise CheckpointError(
                        f"{what}: {path / candidate} is a symbolic link leading out of {path}; only files in the "
                        "folder given are read: give the file's own path, or copy it into the folder"
                    )
                return open_source(path / candidate, what)
        raise FileNotFoundError(f"{what}: {path} holds no model.safetensors(.index.json) or pytorch_model.bin")
    if path.exists() and not path.is_file():
        raise CheckpointError(
            f"{what}: {path} is not a regular file (a pipe, socket or device); checkpoints are read "
            "by offset, so save it to a file first"
        )
    if not path.is_file():
        raise FileNotFoundError(f"{what}: no such checkpoint file: {path}")
    if path.name.endswith(".index.json"):
        return SafetensorsSource(_index_shards(path))
    if path.suffix == ".safetensors":
        return SafetensorsSource([path])
    if path.suffix in (".pt", ".pth", ".bin"):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise CheckpointError(
                f"{what}: {path} cannot be read with torch.load(weights_only=True) ({exc}); "
                "it may be corrupt or hold arbitrary Python objects, which are never unpickled"
            ) from exc
        if not isinstance(state, Mapping):
            raise CheckpointError(f"{what}: {path} holds a {type(state).__name__}, not a state dict")
        return DictSource(state, what)
    raise ValueError(
        f"{what}: unsupported checkpoint file {path.name!r}; use .safetensors, *.index.json, .pt, .pth or .bin"
    )
