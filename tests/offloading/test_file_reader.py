"""Reads of weights streamed from a checkpoint: threads, read-ahead across forwards, direct I/O, errors."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_host_tier import WIDTHS, X, block_bytes, read_directly_or_not, saved, skeleton, streamed

import tardy
import torchsurgery
from torchsurgery.offloading import file_reader


def reader_of(handle: torchsurgery.OffloadHandle) -> file_reader.FileReader:
    return handle._streaming.reader


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_direct_and_buffered_reads_give_the_file_bytes(direct: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, path = saved(tmp_path)
    read_directly_or_not(path, direct, monkeypatch)
    monkeypatch.setattr(file_reader, "_PIECE", 1000)  # reads split inside tensors, at unaligned offsets
    model = skeleton()
    with torch.no_grad():
        handle = torchsurgery.offload(model, storage=path, host_budget=block_bytes(8))
        for _ in range(2):
            torch.testing.assert_close(model(X), reference(X), rtol=0, atol=0)
        assert reader_of(handle).direct is direct  # (a direct read the filesystem refused falls back for good)
    handle.remove()


@pytest.mark.parametrize("late", [{"delay": (0.0, 0.003), "seed": 11}, {"lazy": True}], ids=["delays", "lazy"])
def test_read_ahead_across_forwards_is_exact_under_the_test_device_delays(
    late: dict[str, Any], on_tardy: torch.device, tmp_path: Path
) -> None:
    reference, path = saved(tmp_path)
    model = skeleton()
    expected = reference.to(on_tardy)(X.to(on_tardy))
    # lazy: a copy from a read buffer runs only when its group is needed, long after it was issued
    with tardy.settings(**late), torch.no_grad():
        handle = torchsurgery.offload(model, on_tardy, storage=path, host_budget=0, **streamed(on_tardy, reference))
        for _ in range(4):
            torch.testing.assert_close(model(X.to(on_tardy)), expected, rtol=0, atol=0)
            assert "blocks.0" in reader_of(handle).reading()  # the next forward's first group: read ahead already
        assert handle.stats().storage_bytes_read == sum(block_bytes(w) for w in WIDTHS)
        handle.remove()


def test_remove_with_a_read_in_flight_waits_for_it_and_restores_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, path = saved(tmp_path)
    model = skeleton()
    entered, gate = threading.Event(), threading.Event()
    plain = file_reader.FileReader._read_piece
    calls = []

    def blocking(self: file_reader.FileReader, name: str, *args: Any) -> None:
        # the second read of the first group: the read ahead of the next forward's first group
        calls.append(name)
        if calls.count("blocks.0") == 2 and name == "blocks.0":
            entered.set()
            gate.wait()
        plain(self, name, *args)

    monkeypatch.setattr(file_reader.FileReader, "_read_piece", blocking)
    with torch.no_grad():
        handle = torchsurgery.offload(model, storage=path, host_budget=0)
        torch.testing.assert_close(model(X), reference(X), rtol=0, atol=0)
    assert entered.wait(60)
    removing = threading.Thread(target=handle.remove)
    removing.start()
    try:
        removing.join(0.5)
        assert removing.is_alive()  # it waits for the read in flight (held until the gate opens)
    finally:
        gate.set()
    removing.join()
    assert not handle.active
    assert all(p.is_meta for p in model.parameters())
    assert not [t for t in threading.enumerate() if t.name.startswith("torchsurgery-read")]


def test_a_failed_read_surfaces_in_the_forward_that_needs_it_naming_the_file(tmp_path: Path) -> None:
    reference, path = saved(tmp_path)
    model = skeleton()
    whole = path.read_bytes()
    with torch.no_grad():
        handle = torchsurgery.offload(model, storage=path, host_budget=0)
        model(X)
        path.write_bytes(whole[: len(whole) // 2])  # truncated while streamed
        with pytest.raises(torchsurgery.CheckpointError, match=str(path)):
            model(X)
        path.write_bytes(whole)  # put back, written in place: still refused (nothing says the bytes match) ...
        with pytest.raises(torchsurgery.CheckpointError, match="changed since it was opened"):
            model(X)
    handle.remove()
    handle = torchsurgery.offload(model, storage=path, host_budget=0)  # ... until offloaded from it again
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference(X), rtol=0, atol=0)
    handle.remove()


def test_an_io_error_in_a_read_thread_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, path = saved(tmp_path)
    model = skeleton()
    plain = os.preadv

    def failing(fd: int, views: Any, offset: int) -> int:
        if threading.current_thread().name.startswith("torchsurgery-read"):
            raise OSError(errno.EIO, "Input/output error")
        return plain(fd, views, offset)

    handle = torchsurgery.offload(model, storage=path, host_budget=0)
    monkeypatch.setattr(os, "preadv", failing)
    with torch.no_grad(), pytest.raises(OSError, match=f"reading group 'blocks.0' from {path}"):
        model(X)
    monkeypatch.setattr(os, "preadv", plain)
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference(X), rtol=0, atol=0)
    handle.remove()


def test_a_group_read_ahead_is_waited_for_before_it_computes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, path = saved(tmp_path)
    model = skeleton()
    gate = threading.Event()
    plain_read, plain_wait = file_reader.FileReader._read_piece, file_reader.concurrent.futures.wait
    calls = []

    def held(self: file_reader.FileReader, name: str, *args: Any) -> None:
        calls.append(name)
        if calls.count("blocks.0") == 2 and name == "blocks.0":  # the next forward's first group, read ahead
            gate.wait()  # lands only once the forward waits for it
        plain_read(self, name, *args)

    armed = threading.Event()

    def waiting(*args: Any, **kwargs: Any) -> Any:
        if armed.is_set():
            gate.set()
        return plain_wait(*args, **kwargs)

    monkeypatch.setattr(file_reader.FileReader, "_read_piece", held)
    monkeypatch.setattr(file_reader.concurrent.futures, "wait", waiting)
    handle = torchsurgery.offload(model, storage=path, host_budget=0)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(X), reference(X), rtol=0, atol=0)
            armed.set()  # from now on, a wait for a read lets the held one land
            torch.testing.assert_close(model(X), reference(X), rtol=0, atol=0)
    finally:
        gate.set()
        handle.remove()
