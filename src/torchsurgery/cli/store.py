"""Writing captures to a safetensors file batch by batch, in bounded memory.

A safetensors file starts with a header that gives every tensor's final shape and
offset, so it cannot be appended to. Each key's batches go to a spill file in a folder
beside the output as they arrive (rows concatenated along the first dimension); ``close``
writes the header and streams the spill files into a file in that folder, renames it to
the output and removes the folder. Memory use is one batch, whatever the total size. Nothing
is written outside the output's folder, and the output appears whole or not at all: an
interrupt of the command removes the folder (``_torchsurgery_interrupt.removed_on_interrupt``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import BinaryIO

import torch

from _torchsurgery_interrupt import removed_on_interrupt
from torchsurgery._validate import safetensors_code


class StreamingWriter:
    """Append tensors per key; ``close()`` produces one safetensors file.

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from safetensors.torch import load_file
        >>> path = Path(tempfile.mkdtemp()) / "out.safetensors"
        >>> writer = StreamingWriter(path, {"note": "demo"})
        >>> writer.append("x", torch.ones(2, 3))
        >>> writer.append("x", torch.zeros(1, 3))
        >>> writer.close()
        {'x': [3, 3]}
        >>> load_file(path)["x"].sum().item()
        6.0
    """

    def __init__(self, path: Path, metadata: dict[str, str]) -> None:
        self.path = path
        self.metadata = metadata
        self._spill = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        self._interrupt = contextlib.ExitStack()
        self._interrupt.enter_context(removed_on_interrupt(self._spill))
        self._files: dict[str, BinaryIO] = {}
        self._shapes: dict[str, list[int]] = {}
        self._dtypes: dict[str, torch.dtype] = {}

    def append(self, key: str, tensor: torch.Tensor) -> None:
        """Add ``tensor``'s rows to ``key`` (same trailing shape and dtype every time)."""
        tensor = tensor.detach().to("cpu").contiguous()
        if safetensors_code(tensor.dtype) is None:
            raise ValueError(f"cannot store {key!r}: dtype {tensor.dtype} has no safetensors name")
        shape = list(tensor.shape) or [1]
        if key in self._shapes:
            known = self._shapes[key]
            if known[1:] != shape[1:] or self._dtypes[key] != tensor.dtype:
                raise ValueError(f"{key!r}: batches must share trailing shape and dtype ({known[1:]} vs {shape[1:]})")
            known[0] += shape[0]
        else:
            self._shapes[key] = shape
            self._dtypes[key] = tensor.dtype
            self._files[key] = open(self._spill / f"{len(self._files)}.bin", "wb")  # noqa: SIM115
        if tensor.numel():
            self._files[key].write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())

    def close(self) -> dict[str, list[int]]:
        """Write the file and remove the spill files; returns each key's final shape."""
        try:
            for f in self._files.values():
                f.close()
            # by hand: safetensors' save_file wants every tensor in memory at once, and captures stream
            header: dict[str, object] = {"__metadata__": self.metadata}
            offset = 0
            for key, shape in self._shapes.items():
                size = (self._spill / f"{list(self._files).index(key)}.bin").stat().st_size
                header[key] = {"dtype": safetensors_code(self._dtypes[key]), "shape": shape, "data_offsets": [offset, offset + size]}
                offset += size
            raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
            raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
            whole = self._spill / "output"
            with open(whole, "wb") as out:
                out.write(struct.pack("<Q", len(raw)))
                out.write(raw)
                for index, _ in enumerate(self._shapes):
                    with open(self._spill / f"{index}.bin", "rb") as part:
                        shutil.copyfileobj(part, out, length=1 << 22)
            os.replace(whole, self.path)
            return {k: list(v) for k, v in self._shapes.items()}
        finally:
            shutil.rmtree(self._spill, ignore_errors=True)
            self._interrupt.close()

    def abort(self) -> None:
        """Drop everything written so far (the output file is not created)."""
        for f in self._files.values():
            f.close()
        shutil.rmtree(self._spill, ignore_errors=True)
        self._interrupt.close()
