"""Reading checkpoints tensor by tensor, without trusting them.

Sources are opened lazily: first every name, shape and dtype is known (so a load can be
checked completely before anything is written), then tensors are read one at a time,
straight into the memory that will hold them when possible.

safetensors files are parsed here rather than memory-mapped: mapped file pages count in
the process's resident memory for as long as the mapping lives, so reading through a
map costs as much memory as the model again. ``readinto`` puts the bytes in the final
tensor and leaves them to the page cache, which is not resident memory. The header is
validated in full (sizes, dtypes, offsets inside the file, no overlaps, UTF-8 names)
before any tensor is read. ``.pt``/``.bin`` files go through
``torch.load(weights_only=True)``, so no arbitrary object is ever unpickled.
"""

from __future__ import annotations

import abc
import io
import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
_MAX_HEADER = 100 * 1024 * 1024


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
    """A checkpoint opened for reading: :meth:`entries` first, then :meth:`read` per tensor."""

    @abc.abstractmethod
    def entries(self) -> dict[str, Entry]:
        """Every stored tensor's name, shape and dtype, without reading any data."""

    @abc.abstractmethod
    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor stored under ``key``; written into ``out`` when given (same shape and dtype)."""

    def close(self) -> None:  # noqa: B027 - sources without files have nothing to release
        """Release open files."""


class DictSource(Source):
    """A state dict already in memory."""

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


@dataclass(frozen=True)
class _Located:
    path: Path
    entry: Entry
    start: int  # absolute byte offset in the file
    nbytes: int


def _parse_header(path: Path, f: BinaryIO) -> dict[str, _Located]:
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
        dtype = _DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
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


class SafetensorsSource(Source):
    """One safetensors file, or the shards listed by a ``*.index.json``."""

    def __init__(self, paths: list[Path]) -> None:
        self._files: dict[Path, BinaryIO] = {}
        self._where: dict[str, _Located] = {}
        try:
            for path in paths:
                f = open(path, "rb")  # noqa: SIM115 - kept open until close()
                self._files[path] = f
                for name, loc in _parse_header(path, f).items():
                    if name in self._where:
                        raise CheckpointError(f"{path}: {name!r} is also stored in {self._where[name].path}")
                    self._where[name] = loc
        except BaseException:
            self.close()
            raise

    def entries(self) -> dict[str, Entry]:
        return {name: loc.entry for name, loc in self._where.items()}

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        loc = self._where[key]
        usable = out is not None and out.device.type == "cpu" and out.dtype == loc.entry.dtype and out.is_contiguous()
        target = out if usable and out is not None else torch.empty(loc.entry.shape, dtype=loc.entry.dtype)
        if loc.nbytes:
            f = self._files[loc.path]
            f.seek(loc.start)
            view = target.detach().reshape(-1).view(torch.uint8).numpy().data  # 0-dim tensors too
            got = cast(io.BufferedReader, f).readinto(view)
            if got != loc.nbytes:
                raise CheckpointError(f"{loc.path}: {key!r} ends early ({got} of {loc.nbytes} bytes)")
        if out is not None and target is not out:
            out.copy_(target)
            return out
        return target

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _index_shards(index: Path) -> list[Path]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index}: not a valid sharded-checkpoint index ({exc})") from exc
    shards = []
    for name in files:
        if not isinstance(name, str) or (shard := (index.parent / name).resolve()).parent != index.parent.resolve():
            raise CheckpointError(f"{index}: shard {name!r} is not a file next to the index")
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
