"""The host tier of weights streamed from a checkpoint: ``offload(storage=..., host_budget=...)``.

The host keeps the groups read first within the budget and reads the others from the file on
every forward; outputs equal the plain model's bit for bit, on the CPU and on the test device.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tardy
import torchsurgery
from torchsurgery.offloading import host_tier
from torchsurgery.offloading.host_fit import host_need

WIDTHS = [8, 16, 32, 8, 16, 24]
X = torch.linspace(-1, 1, 3 * 16).reshape(3, 16)


class Blocks(nn.Module):
    def __init__(self, widths: list[int], d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, w), nn.GELU(), nn.Linear(w, d)) for w in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _refuse(path: Any) -> int:
    raise OSError(errno.EINVAL, "direct I/O refused")  # as tmpfs does


def read_directly_or_not(path: Path, direct: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads of ``path`` past the page cache (skipped where its filesystem refuses them), or through
    it as on a filesystem without direct I/O (tmpfs)."""
    from torchsurgery.offloading import file_reader

    if direct:
        try:
            os.close(file_reader._open_direct(path))
        except OSError:
            pytest.skip("this filesystem refuses direct I/O")
    else:
        monkeypatch.setattr(file_reader, "_open_direct", _refuse)


def block_bytes(w: int, d: int = 16) -> int:
    return (d * w + w + w * d + d) * 4


def saved(tmp_path: Path, widths: list[int] = WIDTHS) -> tuple[Blocks, Path]:
    from safetensors.torch import save_file

    reference = Blocks(widths)
    path = tmp_path / "blocks.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path)
    return reference, path


def skeleton(widths: list[int] = WIDTHS) -> Blocks:
    with torchsurgery.skeleton():
        return Blocks(widths)


def streamed(device: torch.device, reference: nn.Module) -> dict[str, Any]:
    """``offload`` arguments under which no group is resident on ``device``."""
    if device.type == "cpu":
        return {}
    with pytest.raises(torchsurgery.BudgetError) as refused:
        torchsurgery.plan_offload(reference, device, budget=1, prefetch=1)
    return {"budget": refused.value.needed}


def test_the_host_keeps_the_groups_read_first_within_its_budget_and_reads_the_rest_every_forward(
    device: torch.device, tmp_path: Path
) -> None:
    reference, path = saved(tmp_path)
    model = skeleton()
    # the first two blocks fit, the third does not; the fourth (as small as the first) does
    budget = 2 * block_bytes(8) + block_bytes(16)
    delays = tardy.settings(delay=(0.0, 0.002), seed=5) if device.type != "cpu" else contextlib.nullcontext()
    with delays, torch.no_grad():
        handle = torchsurgery.offload(model, device, storage=path, host_budget=budget, **streamed(device, reference))
        assert [g.tier for g in handle.plan.groups] == ["host", "host", "disk", "host", "disk", "disk"]
        expected = reference.to(device)(X.to(device))
        reads = []
        for _ in range(3):
            torch.testing.assert_close(model(X.to(device)), expected, rtol=0, atol=0)
            reads.append(handle.stats().storage_bytes_read)
        stats = handle.stats()
        handle.remove()
    disk = block_bytes(32) + block_bytes(16) + block_bytes(24)
    assert reads == [sum(block_bytes(w) for w in WIDTHS), disk, disk]
    assert stats.peak_host_bytes == budget
    assert all(p.is_meta for p in model.parameters())  # back to the skeleton it was


@pytest.mark.parametrize("cut", [500, 1000, 1088], ids=["inside-a-weight", "in-a-later-piece", "between-weights"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_where_the_budget_ends_inside_a_group_the_host_keeps_its_first_bytes_and_reads_the_rest(
    device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: int, direct: bool
) -> None:
    from torchsurgery.offloading import file_reader

    reference, path = saved(tmp_path)
    read_directly_or_not(path, direct, monkeypatch)
    monkeypatch.setattr(file_reader, "_PIECE", 640)  # the kept bytes end inside a read's piece, or after several
    model = skeleton()
    budget = block_bytes(8) + cut  # the first block and part of the second (1088: its first weight and bias)
    with torch.no_grad():
        handle = torchsurgery.offload(model, device, storage=path, host_budget=budget, **streamed(device, reference))
        assert [g.tier for g in handle.plan.groups] == ["host", "split", "disk", "disk", "disk", "disk"]
        assert [g.host_bytes for g in handle.plan.groups][:2] == [block_bytes(8), cut]
        expected = reference.to(device)(X.to(device))
        reads = []
        for _ in range(3):
            torch.testing.assert_close(model(X.to(device)), expected, rtol=0, atol=0)
            reads.append(handle.stats().storage_bytes_read)
        stats = handle.stats()
        handle.remove()
    total = sum(block_bytes(w) for w in WIDTHS)
    assert reads == [total, total - budget, total - budget]  # the whole budget saves reads
    assert stats.peak_host_bytes == budget
    assert all(p.is_meta for p in model.parameters())


def stalls_by_this_clock(monkeypatch: pytest.MonkeyPatch, seconds: dict[int, float], names: list[str]) -> None:
    """A clock by which the forward waits ``seconds[i]`` for the bytes of group ``names[i]``."""
    from torchsurgery.offloading import file_reader

    taking, now = [""], [0.0]
    take = file_reader.FileReader.take

    def taking_group(self: file_reader.FileReader, group: Any) -> torch.Tensor:
        taking[0] = group.name
        return take(self, group)

    def clock() -> float:  # called as the wait starts and as it ends: each call moves by the group's seconds
        now[0] += seconds.get(names.index(taking[0]), 0.0) if taking[0] in names else 0.0
        return now[0]

    monkeypatch.setattr(file_reader.FileReader, "take", taking_group)
    monkeypatch.setattr(file_reader, "_clock", clock)


@pytest.mark.parametrize("waits", [{1: 1.0}, {0: 0.5, 1: 0.5, 2: 0.5, 3: 0.52}, {0: 0.5, 3: 0.8}],
                         ids=["one-group-waits", "waits-alike", "less-than-twice-the-kept-group-s-wait"])
def test_after_the_first_forward_the_host_keeps_the_groups_whose_reads_kept_it_waiting_clearly_longer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, waits: dict[int, float]
) -> None:
    widths = [16, 16, 16, 16]
    reference, path = saved(tmp_path, widths)
    model = skeleton(widths)
    handle = torchsurgery.offload(model, storage=path, host_budget=block_bytes(16))
    assert [g.tier for g in handle.plan.groups] == ["host", "disk", "disk", "disk"]  # model order, until measured
    stalls_by_this_clock(monkeypatch, waits, [g.name for g in handle.plan.groups])
    reads = []
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(X), reference(X), rtol=0, atol=0)
            reads.append(handle.stats().storage_bytes_read)
    b = block_bytes(16)
    if len(waits) == 1:  # the second group's read kept the forward waiting: the host keeps it from then on
        assert [g.tier for g in handle.plan.groups] == ["disk", "host", "disk", "disk"]
        # its read ahead of the second forward was in flight as the host chose it (into a read
        # buffer): kept from that read; the second forward reads the first group again
        assert reads == [4 * b, 4 * b, 3 * b]
    else:  # a choice that saves little over the one kept (or less than twice its waits) is no gain: it costs reads
        assert [g.tier for g in handle.plan.groups] == ["host", "disk", "disk", "disk"]
        assert reads == [4 * b, 3 * b, 3 * b]
    assert handle.stats().peak_host_bytes == b
    handle.remove()


def test_the_plan_shows_each_group_tier(tmp_path: Path) -> None:
    reference, path = saved(tmp_path, [8, 8])
    plan = torchsurgery.plan_offload(skeleton([8, 8]), storage=path, host_budget=block_bytes(8))
    lines = str(plan).splitlines()
    assert "host budget" in lines[0]
    assert lines[1].split()[:2] == ["group", "tier"]
    assert [line.split()[1] for line in lines[2:]] == ["host"] * 4 + ["disk"] * 4


def test_the_host_tier_counts_the_bytes_the_file_stores(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    reference = Blocks(WIDTHS).to(torch.bfloat16)
    path = tmp_path / "bf16.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path)
    halves = (block_bytes(8) + block_bytes(16)) // 2  # the first two blocks in bf16
    model = skeleton()
    handle = torchsurgery.offload(model, storage=path, host_budget=halves, dtype=torch.float32)
    assert [g.tier for g in handle.plan.groups] == ["host", "host", "disk", "disk", "disk", "disk"]
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(X), reference.float()(X), rtol=0, atol=0)
    assert handle.stats().peak_host_bytes == halves
    handle.remove()


def test_inspect_shows_how_many_groups_sit_in_each_tier(tmp_path: Path) -> None:
    from torchsurgery.cli.inspect import module_rows

    reference, path = saved(tmp_path)
    model = skeleton()
    with torchsurgery.offload(model, storage=path, host_budget=block_bytes(8) + block_bytes(16)):
        surgery = module_rows(model, 0, None)[0]["surgery"]
    assert any("2 kept in host memory, 4 read every forward" in line for line in surgery)


def test_without_a_host_budget_the_host_keeps_what_is_available_less_a_margin_and_the_read_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read buffers of the groups read on every forward come first (host_fit); the host tier keeps
    groups in what is left. Many small blocks: more bytes than the buffers, not all kept."""
    widths = [8] * 128
    reference, path = saved(tmp_path, widths)
    given = torchsurgery.plan_offload(skeleton(widths), storage=path, host_budget=0)
    buffers = host_need(given.groups, given.prefetch, given.offload_device)
    assert 0 < buffers < sum(map(block_bytes, widths))
    monkeypatch.setattr(host_tier, "available_memory", lambda: host_tier.MARGIN + buffers + 2 * block_bytes(8))
    plan = torchsurgery.plan_offload(skeleton(widths), storage=path)
    assert plan.host_budget == 2 * block_bytes(8)
    assert [g.tier for g in plan.groups] == ["host", "host"] + ["disk"] * 126
    monkeypatch.setattr(host_tier, "available_memory", lambda: host_tier.MARGIN // 2)  # never more than available
    with pytest.warns(UserWarning, match="in part of that margin"):
        assert {g.tier for g in torchsurgery.plan_offload(skeleton(widths), storage=path).groups} == {"disk"}


def test_a_host_budget_that_is_no_byte_count_is_refused_before_anything_changes(tmp_path: Path) -> None:
    reference, path = saved(tmp_path)
    model = skeleton()
    with pytest.raises(ValueError, match="host_budget"):
        torchsurgery.offload(model, storage=path, host_budget=-1)
    assert not torchsurgery.surgery_log(model)


def host_bytes(handle: torchsurgery.OffloadHandle) -> int:
    return sum(g.host_bytes for g in handle.plan.groups)


def test_models_offloaded_with_one_host_account_share_its_budget(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (ref_a, path_a), (ref_b, path_b) = saved(tmp_path / "a"), saved(tmp_path / "b")
    account = host_tier.HostAccount(2 * block_bytes(8) + block_bytes(16))
    a, b = skeleton(), skeleton()
    handle_a = torchsurgery.offload(a, storage=path_a, host_budget=account)
    handle_b = torchsurgery.offload(b, storage=path_b, host_budget=account)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(a(X), ref_a(X), rtol=0, atol=0)
            torch.testing.assert_close(b(X), ref_b(X), rtol=0, atol=0)
    assert [g.tier for g in handle_a.plan.groups] == ["host", "host", "disk", "host", "disk", "disk"]
    assert [g.tier for g in handle_b.plan.groups] == ["disk"] * 6  # a holds the whole budget
    assert handle_a.stats().peak_host_bytes + handle_b.stats().peak_host_bytes <= account.budget
    assert handle_b.stats().storage_bytes_read == sum(block_bytes(w) for w in WIDTHS)
    handle_a.remove()
    assert account.free_bytes() == account.budget  # removing the offload frees its host bytes
    handle_b.remove()


def test_a_pool_gives_its_host_budget_to_the_model_it_loads(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (ref_a, path_a), (ref_b, path_b) = saved(tmp_path / "a"), saved(tmp_path / "b")
    host = 2 * block_bytes(8) + block_bytes(16)
    # room on the device (here host memory too) for one model at a time, streamed
    pool = torchsurgery.DevicePool("cpu", budget=2 * block_bytes(32), host_budget=host)
    a = pool.add(skeleton(), name="a", storage=path_a)
    b = pool.add(skeleton(), name="b", storage=path_b)
    for model, reference in [(a, ref_a), (b, ref_b), (a, ref_a)]:  # each load pushes the other back
        handle = pool.load(model)
        with torch.no_grad():
            for _ in range(2):
                torch.testing.assert_close(model(X), reference(X), rtol=0, atol=0)
        kept = host_bytes(handle)
        assert 2 * kept > host  # only one model's host tier fits: the other's was given back
        assert handle.stats().peak_host_bytes == kept == pool.host.held(handle._streaming.reader)
    pool.close()
    assert pool.host.free_bytes() == host
    assert all(p.is_meta for p in list(a.parameters()) + list(b.parameters()))
