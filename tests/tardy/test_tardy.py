"""The test device itself: what it promises the other tests (late copies, poison, hazards, memory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tardy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _tardy_only(on_tardy: torch.device) -> None:
    """Every test here is about the test device (skipped where the suite runs on a GPU)."""


def pinned(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).pin_memory()


def test_it_is_the_accelerator_torch_reports() -> None:
    assert torch.accelerator.current_accelerator() == torch.device(tardy.NAME)
    assert torch.accelerator.device_count() == 1 and torch.tardy is tardy  # type: ignore[attr-defined]
    x = torch.arange(4.0, device="tardy")
    assert x.device == torch.device("tardy", 0)
    torch.testing.assert_close((x * 2 + 1).cpu(), torch.tensor([1.0, 3.0, 5.0, 7.0]), rtol=0, atol=0)


def test_device_memory_is_reached_only_through_the_device() -> None:
    x = torch.ones(3, device="tardy")
    with pytest.raises(RuntimeError, match=r"found at least two devices, tardy:0 and cpu"):
        torch.add(x, torch.ones(3))
    assert (x + torch.tensor(1.0)).cpu().tolist() == [2.0, 2.0, 2.0]  # a 0-d host tensor joins, as on CUDA


def test_fresh_device_memory_holds_poison() -> None:
    assert torch.empty(4, device="tardy").cpu().isnan().all()


def test_pinned_host_memory_is_pinned_and_plain_memory_is_not() -> None:
    assert torch.empty(8, pin_memory=True).is_pinned()
    assert torch.ones(8).pin_memory().is_pinned()
    assert not torch.ones(8).is_pinned()


def test_a_lazy_copy_runs_only_when_waited_for_and_lands_in_stream_order() -> None:
    side = torch.Stream(device="tardy")
    source = pinned([1.0, 2.0, 3.0])
    with tardy.settings(lazy=True):
        dst = torch.empty(3, device="tardy")
        with side:
            dst.copy_(source, non_blocking=True)
            done = torch.Event(device="tardy")
            done.record(side)
        assert tardy.in_flight() == 2 and not done.query()  # nothing ran: lazy
        source.fill_(7.0)  # pinned memory is read when the copy lands, not when it is issued
        torch.accelerator.current_stream().wait_event(done)
        assert dst.cpu().tolist() == [7.0, 7.0, 7.0]  # the compute stream waited: the copy ran first
        assert done.query() and tardy.in_flight() == 0


def test_a_pageable_source_is_read_at_the_call_and_the_destination_lands_late() -> None:
    side = torch.Stream(device="tardy")
    source = torch.tensor([1.0, 2.0])
    before = tardy.pageable_copies()
    with tardy.settings(lazy=True):
        dst = torch.empty(2, device="tardy")
        with side:
            dst.copy_(source, non_blocking=True)
        source.fill_(9.0)  # too late: the bytes were taken at the call, as CUDA stages them
        assert tardy.pageable_copies() == before + 1 and tardy.in_flight() == 1
        side.synchronize()
        assert dst.cpu().tolist() == [1.0, 2.0]


def test_a_copy_into_pinned_host_memory_lands_when_waited_for_and_into_pageable_memory_at_once() -> None:
    x = torch.tensor([4.0, 5.0], device="tardy")
    with tardy.settings(lazy=True):
        host = torch.zeros(2, pin_memory=True)
        host.copy_(x, non_blocking=True)
        assert host.tolist() == [0.0, 0.0]  # not landed yet
        torch.accelerator.synchronize()
        assert host.tolist() == [4.0, 5.0]
        plain = torch.zeros(2)
        plain.copy_(x, non_blocking=True)
        assert plain.tolist() == [4.0, 5.0]


def test_reading_what_another_stream_writes_without_an_event_is_a_hazard() -> None:
    side = torch.Stream(device="tardy")
    dst = torch.empty(2, device="tardy")
    with tardy.settings(lazy=True):
        with side:
            dst.copy_(pinned([1.0, 2.0]), non_blocking=True)
        with pytest.raises(RuntimeError, match="hazard: aten::add.* on stream 0 reads .* that stream [1-8] wrote without an event"):
            dst + 1
        torch.accelerator.current_stream().wait_stream(side)
        assert (dst + 1).cpu().tolist() == [2.0, 3.0]


def test_overwriting_what_another_stream_reads_without_an_event_is_a_hazard() -> None:
    side = torch.Stream(device="tardy")
    buffer = torch.ones(2, device="tardy")
    total = buffer.sum()  # read on the default stream
    with side, pytest.raises(RuntimeError, match="hazard: a copy on stream [1-8] writes .* that stream 0 (wrote|read) without an event"):
        buffer.copy_(pinned([3.0, 4.0]), non_blocking=True)
    side.wait_stream(torch.accelerator.current_stream())
    with side:
        buffer.copy_(pinned([3.0, 4.0]), non_blocking=True)
    side.synchronize()
    assert total.item() == 2.0 and buffer.cpu().tolist() == [3.0, 4.0]


def test_freeing_memory_another_stream_still_uses_is_reported() -> None:
    side = torch.Stream(device="tardy")
    with tardy.settings(lazy=True):
        buffer = torch.empty(4, device="tardy")  # allocated on the default stream
        with side:
            buffer.copy_(pinned([1.0, 2.0, 3.0, 4.0]), non_blocking=True)
        del buffer  # the default stream may reuse it while the copy has not run
        with pytest.raises(RuntimeError, match="was freed while its use on stream [1-8] was not ordered"):
            torch.accelerator.synchronize()  # the next call into the device reports it
    ok = torch.empty(4, device="tardy")
    with side:
        ok.copy_(pinned([1.0, 2.0, 3.0, 4.0]), non_blocking=True)
    ok.record_stream(side)  # as on CUDA: the allocator orders its reuse after the side stream
    del ok
    torch.accelerator.synchronize()
    assert tardy.hazards() == []


def test_work_on_one_stream_runs_in_order_whatever_the_delays() -> None:
    side = torch.Stream(device="tardy")
    with tardy.settings(delay=(0.0, 0.002), seed=3):
        dst = torch.empty(4, device="tardy")
        with side:
            for value in range(10):
                dst.copy_(torch.full((4,), float(value)).pin_memory(), non_blocking=True)
            start, end = torch.Event(device="tardy", enable_timing=True), torch.Event(device="tardy", enable_timing=True)
            start.record(side)
            doubled = dst * 2  # compute on the side stream follows its copies without an event
            end.record(side)
        torch.accelerator.current_stream().wait_stream(side)
        assert doubled.cpu().tolist() == [18.0] * 4 and start.elapsed_time(end) >= 0


def test_memory_statistics_and_out_of_memory_within_the_capacity() -> None:
    torch.accelerator.synchronize()
    with tardy.settings(capacity=torch.accelerator.memory_allocated() + (1 << 20)):
        base = torch.accelerator.memory_allocated()
        torch.accelerator.reset_peak_memory_stats()
        half = torch.empty(1 << 19, dtype=torch.uint8, device="tardy")
        assert torch.accelerator.memory_allocated() == base + (1 << 19)
        free, total = torch.accelerator.get_memory_info()
        assert total - free == base + (1 << 19)
        with pytest.raises(torch.OutOfMemoryError, match=r"tardy: out of memory: tried to allocate 1048576 bytes"):
            torch.empty(1 << 20, dtype=torch.uint8, device="tardy")
        assert torch.accelerator.memory_stats()["num_ooms"] >= 1
        del half
        assert torch.accelerator.memory_allocated() == base
        assert torch.accelerator.max_memory_allocated() == base + (1 << 19)
        torch.empty(1 << 20, dtype=torch.uint8, device="tardy")  # fits again


def test_autograd_and_convolutions_run_through_the_cpu_fallback() -> None:
    conv = torch.nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(1, 2, 5, 5)
    conv(x).square().sum().backward()
    expected = conv.weight.grad.clone()  # type: ignore[union-attr]
    conv.zero_grad()
    conv.to("tardy")
    conv(x.to("tardy")).square().sum().backward()
    torch.testing.assert_close(conv.weight.grad.cpu(), expected, rtol=0, atol=0)  # type: ignore[union-attr]


def test_the_suite_stops_loudly_when_the_device_cannot_be_built(tmp_path: Path) -> None:
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_format.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "the test accelerator could not be built" in done.stdout + done.stderr
