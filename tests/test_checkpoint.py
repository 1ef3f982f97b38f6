"""Tests of torchsurgery._checkpoint: bulk reads, private maps and the stash, against safetensors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from torchsurgery import CheckpointError, _checkpoint
from torchsurgery._checkpoint import SafetensorsSource, Stash, open_source


def _state() -> dict[str, torch.Tensor]:
    state = {f"t{i:03d}": torch.randn(i % 7 + 1, 3) for i in range(100)}
    state.update(
        big=torch.randn(64, 64),
        half=torch.randn(5, 3).bfloat16(),
        fp8=torch.randn(8).to(torch.float8_e4m3fn),
        ints=torch.arange(10, dtype=torch.int32),
        flags=torch.tensor([True, False, True]),
        scalar=torch.tensor(3.5),
        empty=torch.zeros(0, 4),
    )
    return state


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _counting(monkeypatch: pytest.MonkeyPatch, limit: int | None = None) -> list[int]:
    """Count os.preadv calls (and let each return at most ``limit`` bytes, as a short read may)."""
    real = os.preadv
    sizes: list[int] = []

    def preadv(fd: int, views: list[memoryview], offset: int) -> int:
        if limit is not None:
            views = [views[0][:limit]]
        done = real(fd, views, offset)
        sizes.append(done)
        return done

    monkeypatch.setattr(_checkpoint.os, "preadv", preadv)
    return sizes


def test_read_many_equals_safetensors_in_few_system_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    save_file(state, tmp_path / "m.safetensors")
    expected = load_file(tmp_path / "m.safetensors")
    source = open_source(tmp_path / "m.safetensors", "test")
    outs = {k: torch.empty_like(v) for k, v in expected.items()}
    calls = _counting(monkeypatch)
    source.read_many(list(outs.items()))
    assert len(calls) == 1  # 107 tensors next to each other in the file: one system call
    for k, v in expected.items():
        assert torch.equal(_bits(outs[k]), _bits(v)), k
    source.close()


def test_short_reads_chunks_and_casts_still_give_every_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    save_file(state, tmp_path / "m.safetensors")
    monkeypatch.setattr(_checkpoint, "_CHUNK", 100)
    monkeypatch.setattr(_checkpoint, "_IOV_MAX", 3)
    calls = _counting(monkeypatch, limit=7)
    source = open_source(tmp_path / "m.safetensors", "test")
    keys = [k for k in state if k not in ("fp8", "flags", "ints")]
    # a dtype of the module's own (cast) and a non-contiguous destination (staged)
    outs = {k: torch.empty(state[k].shape, dtype=torch.float64) for k in keys}
    wide = torch.empty(3, 64, 2)[:, :, 0]
    outs["big"] = torch.empty(64, 64).t()
    outs["t001"] = wide[:2, :3]
    source.read_many(list(outs.items()))
    assert max(calls) <= 7 and len(calls) > 100
    for k in keys:
        torch.testing.assert_close(outs[k], state[k].double() if k not in ("big", "t001") else state[k], rtol=0, atol=0, check_dtype=False)
    source.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_shards_are_read_in_parallel_and_errors_come_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    state = _state()
    keys = sorted(state)
    save_file({k: state[k] for k in keys[:50]}, tmp_path / "a.safetensors")
    save_file({k: state[k] for k in keys[50:]}, tmp_path / "b.safetensors")
    monkeypatch.setattr(_checkpoint, "_THREADS", threads)
    monkeypatch.setattr(_checkpoint, "_PARALLEL_BYTES", 0)
    monkeypatch.setattr(_checkpoint, "_CHUNK", 256)
    source = SafetensorsSource([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    outs = [(k, torch.empty_like(state[k])) for k in keys]
    source.read_many(outs)
    for k, out in outs:
        assert torch.equal(_bits(out), _bits(state[k])), k
    real = os.preadv
    calls = 0

    def failing(fd: int, views: list[memoryview], offset: int) -> int:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise OSError(5, "Input/output error")
        return real(fd, views, offset)

    monkeypatch.setattr(_checkpoint.os, "preadv", failing)
    with pytest.raises(OSError, match="Input/output error"):
        source.read_many(outs)
    source.close()


def test_a_file_cut_short_after_its_header_was_read_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.randn(100), "b": torch.randn(100)}, path)
    source = open_source(path, "test")
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10)
    with pytest.raises(CheckpointError, match="'b' ends early"):
        source.read("b")
    with pytest.raises(CheckpointError, match="'b' ends early"):
        source.mapped("b")
    source.close()


def test_mapped_tensors_are_views_of_a_private_map(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    state = _state()
    save_file(state, path)
    source = open_source(path, "test")
    mapped = {k: source.mapped(k) for k in state}
    source.close()  # the map outlives the source
    storages = {v.untyped_storage().data_ptr() for v in mapped.values() if v is not None}
    assert len(storages) == 1  # one map of the file, shared by every tensor
    for k, v in mapped.items():
        assert v is not None and torch.equal(_bits(v), _bits(state[k])), k
    big = mapped["big"]
    assert big is not None
    big.mul_(2)  # writes go to private pages, never to the file
    assert torch.equal(load_file(path)["big"], state["big"])
    torch.testing.assert_close(big, state["big"] * 2)


def test_a_misaligned_tensor_is_not_mapped(tmp_path: Path) -> None:
    import json
    import struct

    header = {"byte": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "w": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned, "w" one byte after
    values = torch.tensor([1.5, -2.0])
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x07" + values.numpy().tobytes())
    source = open_source(path, "test")
    assert source.mapped("w") is None
    assert torch.equal(source.read("w"), values)
    source.close()


def test_stash_puts_back_every_kind_of_tensor() -> None:
    base = torch.randn(4, 6)
    tensors = [torch.randn(1000), torch.randn(3, 3).bfloat16(), base.t(), torch.tensor(2.0), torch.zeros(0), torch.arange(5)]
    before = [t.clone() for t in tensors]
    stash = Stash(tensors)
    for t in tensors:
        t.zero_() if not t.is_floating_point() else t.fill_(float("nan"))
    stash.restore()
    stash.close()
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t, b)


def test_stash_failing_to_keep_leaves_nothing_open(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args: Any) -> int:
        raise OSError(28, "No space left on device")

    opened: list[int] = []
    real = _checkpoint._anonymous_file

    def anonymous() -> int:
        opened.append(real())
        return opened[-1]

    monkeypatch.setattr(_checkpoint, "_anonymous_file", anonymous)
    monkeypatch.setattr(_checkpoint.os, "pwritev", full)
    with pytest.raises(OSError, match="No space"):
        Stash([torch.randn(10)])
    with pytest.raises(OSError):
        os.fstat(opened[0])  # closed


@pytest.mark.parametrize("can_map", [True, False])
def test_stash_keeps_values_that_outlive_it(monkeypatch: pytest.MonkeyPatch, can_map: bool) -> None:
    if not can_map:

        def no_map(*args: Any) -> Any:
            raise OSError(12, "Cannot allocate memory")

        monkeypatch.setattr(_checkpoint.mmap, "mmap", no_map)
    # a 3-byte tensor first: the next one lies at an offset its dtype cannot be viewed at
    tensors = [
        torch.tensor([True, False, True]),
        torch.randn(7),
        torch.arange(5, dtype=torch.int8),
        torch.randn(2, 3).bfloat16(),
        torch.randn(4, 4).t(),  # not contiguous: copied
    ]
    before = [t.clone() for t in tensors]
    stash = Stash(tensors)
    kept = stash.keep()
    stash.close()
    for t in tensors:
        t.zero_()
    for k, b in zip(kept, before, strict=True):
        assert k.device.type == "cpu" and k.dtype == b.dtype and torch.equal(k, b)
    if can_map:  # the in-memory file mapped, not copied: one memory for the aligned ones
        assert len({kept[i].untyped_storage().data_ptr() for i in (0, 2, 3)}) == 1
