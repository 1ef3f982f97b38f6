"""The device seam, and the streaming engine run on the accelerator while copies land late.

On a CPU every copy is synchronous, so an ordering mistake in the streaming engine cannot
show. On the accelerator (the machine's own, or the suite's test device ``tests/tardy``)
the engine runs through :class:`AcceleratorDevice` with real streams, events and pinned
memory; on the test device copies land late (after random delays, or only when waited for)
into poisoned memory, and a use of memory another stream touched without an event in
between raises at once. Everything here compares with the resident model.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _residency import best_stall, in_order
from torch import nn

import tardy
import torchsurgery
from torchsurgery import Residency, offload
from torchsurgery._device import AcceleratorDevice, resolve_device
from torchsurgery.offloading import stored_values
from torchsurgery.offloading.residency import GroupCost, plan_residency, simulate


class Blocks(nn.Module):
    """Residual MLP blocks run in ``self.order`` (default: in turn); block i has hidden width ``widths[i]``."""

    def __init__(self, widths: list[int], d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, w), nn.GELU(), nn.Linear(w, d)) for w in widths)
        self.order: list[int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order if self.order is not None else range(len(self.blocks)):
            x = x + self.blocks[i](x)
        return x


def identity_map(model: nn.Module) -> dict[str, tuple[int, torch.device, torch.dtype]]:
    return {n: (id(t), t.device, t.dtype) for n, t in model.named_parameters(remove_duplicate=False)}


def exact(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def stream_all(
    model: nn.Module, prefetch: int, storage_dtype: torch.dtype = torch.float32, device: Any = None
) -> dict[str, int]:
    """``offload`` arguments under which every group streams: the least budget accepted, what the
    ring's slots and a run take with nothing resident, as ``device`` counts it (default: the
    accelerator). A model smaller than that is kept whole: it needs groups of similar size, more
    than ``prefetch + 1`` of them (more still where a run casts its weights).
    """
    device = device if device is not None else torch.accelerator.current_accelerator()
    assert device is not None
    with pytest.raises(torchsurgery.BudgetError) as refused:
        torchsurgery.plan_offload(model, device, budget=1, prefetch=prefetch, storage_dtype=storage_dtype)
    return {"prefetch": prefetch, "budget": refused.value.needed}


X = torch.linspace(-1, 1, 3 * 16).reshape(3, 16)


def tuned(accelerator: torch.device, **changes: Any) -> contextlib.AbstractContextManager[Any]:
    """On the test device: its settings changed by ``changes`` (``lazy``, ``delay``, ``seed``). Elsewhere: as the device is."""
    return tardy.settings(**changes) if accelerator.type == tardy.NAME else contextlib.nullcontext()


def late(accelerator: torch.device) -> contextlib.AbstractContextManager[Any]:
    """On the test device: copies run only when something waits for them. Elsewhere: as the device is."""
    return tuned(accelerator, lazy=True)


def counters() -> tuple[int, int]:
    """The test device's copies and pageable copies issued so far (0, 0 on another accelerator)."""
    return (tardy.copies(), tardy.pageable_copies()) if tardy.registered() else (0, 0)


def slow_link(widths: list[int], link: float) -> dict[str, tuple[float, float]]:
    """The test device's delay for a link of ``link`` bytes per second: every copy takes as long as
    the largest of ``Blocks(widths)``'s groups over the link (a copy of a group is one copy)."""
    largest = max((16 * w + w + w * 16 + 16) * 4 for w in widths)
    return {"delay": (largest / link, largest / link)}


class _Dropped:
    """The event of a dropped record: complete from the start, so that nothing waits for it."""


_DROPPED = _Dropped()
_PACKAGE = Path(torchsurgery.__file__).parent


class Watched(AcceleratorDevice):
    """The accelerator as the engine uses it, watched: it counts the copies through the seam
    (``copies``), notes the call sites in the package of every ``record``, ``wait`` and
    ``synchronize`` (``sites``) and the record sites whose events something waited on
    (``ordering``), and can drop one ordering operation at one call site (``drop``:
    ``(operation, "file.py:line")``), which then does nothing there, as if the engine lacked that line.
    """

    def __init__(self, device: torch.device, drop: tuple[str, str] | None = None) -> None:
        super().__init__(device)
        self.drop = drop
        self.copies = 0
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()
        self.ordering: set[str] = set()
        self._recorded: dict[int, tuple[Any, str]] = {}  # id(event) -> (event, its record site); the event kept alive

    def _site(self, operation: str) -> tuple[str, str]:
        frame = sys._getframe(2)  # the caller of the operation
        path = Path(frame.f_code.co_filename)
        if _PACKAGE not in path.parents:
            return (operation, "")
        site = (operation, f"{path.name}:{frame.f_lineno}")
        self.sites[site] += 1
        return site

    def _waited(self, event: Any) -> None:
        if id(event) in self._recorded:
            self.ordering.add(self._recorded[id(event)][1])

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        self.copies += 1
        super().copy_(dst, src, stream)

    def record(self, stream: Any) -> Any:
        site = self._site("record")
        if site == self.drop:
            return _DROPPED
        event = super().record(stream)
        self._recorded[id(event)] = (event, site[1])
        return event

    def wait(self, stream: Any, event: Any) -> None:
        if self._site("wait") == self.drop or event is _DROPPED:
            return
        self._waited(event)
        super().wait(stream, event)

    def synchronize(self, what: Any = None) -> None:
        if self._site("synchronize") == self.drop or what is _DROPPED:
            return
        self._waited(what)
        super().synchronize(what)

    def elapsed(self, start: Any, end: Any) -> float:
        return 0.0 if _DROPPED in (start, end) else super().elapsed(start, end)



# ---------------------------------------------------------------------- the device seam on the test device


def test_the_device_seam_keeps_cudas_ordering_rules_on_the_test_device(on_tardy: torch.device) -> None:
    dev = resolve_device(on_tardy, "test")
    with tardy.settings(lazy=True):
        compute, a, b = dev.current_stream(), dev.new_stream(), dev.new_stream()
        host = dev.pin(torch.arange(8, dtype=torch.uint8))
        x, y = dev.empty(8), dev.empty(8)
        dev.copy_(x, host, a)
        assert tardy.in_flight() > 0  # not waited for: poison until it lands ...
        with pytest.raises(RuntimeError, match="tardy: hazard"):  # ... and computing on it is refused
            x.sum()
        dev.wait(b, dev.record(a))  # b's work runs after a's copy
        dev.copy_(y, x, b)
        dev.wait(compute, dev.record(b))
        assert torch.equal(y.cpu(), host) and torch.equal(x.cpu(), host)
        dev.wait(a, dev.record(compute))  # a's next copies come after those reads
        dev.copy_(x, host, a)
        host.fill_(7)  # refilled before the copy landed: the copy moves the new bytes
        dev.synchronize(a)
        assert (x.cpu() == 7).all()
        dev.wait(a, dev.record(compute))
        pageable, before = torch.zeros(8, dtype=torch.uint8), tardy.pageable_copies()
        dev.copy_(x, pageable, a)  # pageable memory: read at the call, as CUDA stages it
        pageable.fill_(9)
        dev.synchronize(a)
        assert (x.cpu() == 0).all() and tardy.pageable_copies() == before + 1
        x.sum()  # a computation reads x ...
        with pytest.raises(RuntimeError, match="tardy: hazard"):  # ... so a copy into x must wait for an event after it
            dev.copy_(x, host, a)
        dev.wait(a, dev.record(compute))
        dev.copy_(x, host, a)
        assert tardy.in_flight() > 0
        dev.synchronize()
        assert tardy.in_flight() == 0 and (x.cpu() == 7).all()
    with tardy.settings(delay=(0.0, 0.003), seed=1):  # in order per stream, whatever the delays
        side, z = dev.new_stream(), dev.empty(4)
        for value in range(20):
            dev.copy_(z, dev.pin(torch.full((4,), value, dtype=torch.uint8)), side)
        start = dev.record(side)
        dev.synchronize(side)
        assert (z.cpu() == 19).all() and isinstance(dev.elapsed(start, dev.record(side)), float)


# ---------------------------------------------------------------------- devices


def test_offload_accepts_cpu_and_the_reported_accelerator_and_refuses_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Blocks([8, 8])
    ids = identity_map(model)
    with pytest.raises(ValueError, match="is not a device"):
        offload(model, "tpu")
    if not torch.accelerator.is_available():
        with pytest.raises(ValueError, match=r"device 'xpu' is not available: this PyTorch reports only 'cpu'"):
            offload(model, "xpu")
        with pytest.raises(ValueError, match=r"device 'cuda:0' is not available"):
            offload(model, torch.device("cuda", 0))
        with pytest.raises(ValueError, match=r"pin_memory is True, but host memory cannot be pinned for 'cpu'.*pass pin_memory=False"):
            offload(model, "cpu", pin_memory=True)
    assert identity_map(model) == ids
    # a machine whose PyTorch reports one XPU: xpu:0 resolves, xpu:3 and cuda do not
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("xpu"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    def no_streams(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("this backend has no streams")

    monkeypatch.setattr(torch, "Stream", no_streams)  # the device then copies synchronously
    with pytest.raises(ValueError, match=r"'xpu:3' does not exist \(1 xpu devices\)"):
        resolve_device("xpu:3", "f")
    with pytest.raises(ValueError, match=r"'cuda' is not available: this PyTorch reports 'cpu' and 'xpu'"):
        resolve_device("cuda", "f")
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no pinned allocator")))
    dev = resolve_device("xpu", "f")
    assert isinstance(dev, AcceleratorDevice) and dev.device == torch.device("xpu", 0)
    assert not dev.host_compute and not dev.can_pin and dev.new_stream() is None


def test_the_cpu_device_copies_synchronously_and_times_on_the_host() -> None:
    dev = resolve_device("cpu", "f")
    side = dev.new_stream()
    buffer = dev.empty(16)
    start = dev.record(side)
    dev.copy_(buffer, torch.arange(16, dtype=torch.uint8), side)
    assert buffer.tolist() == list(range(16)) and isinstance(dev.elapsed(start, dev.record(side)), float)
    with pytest.raises(RuntimeError, match="give a budget"):
        dev.free_memory()


# ---------------------------------------------------------------------- streaming while copies land late


@pytest.mark.accelerator
@pytest.mark.parametrize("lazy", [False, True], ids=["random-delays", "lazy"])
@pytest.mark.parametrize("storage_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-storage"])
@pytest.mark.parametrize("prefetch", [0, 1, 2, 3, 7])
def test_streamed_forwards_match_the_resident_model(
    accelerator: torch.device, prefetch: int, storage_dtype: torch.dtype | None, lazy: bool
) -> None:
    # two largest groups: neither can be resident; enough others that prefetch + 1 slots hold less than the model
    model = Blocks([8, 32, 8, 32, 16, 8] + [16, 24] * prefetch)
    reference = copy.deepcopy(model)
    if storage_dtype is not None:
        with torch.no_grad():
            for p in reference.parameters():
                p.copy_(p.to(storage_dtype))
    reference.to(accelerator)
    x = X.to(accelerator)
    ids = identity_map(model)
    settings: dict[str, Any] = {"lazy": True} if lazy else {"seed": prefetch, "delay": (0.0, 0.002)}
    with tuned(accelerator, **settings), torch.no_grad():
        expected = reference(x)
        _, pageable = counters()
        dev = Watched(accelerator)
        handle = offload(
            model, dev, dtype=torch.float32, storage_dtype=storage_dtype, skip=None,
            **stream_all(model, prefetch, storage_dtype=storage_dtype or torch.float32),
        )
        assert {p.residency for p in handle.plan.params} == {Residency.STREAMED}  # every group rides the ring
        for _ in range(4):
            exact(model(x), expected)
        s = handle.stats()
        assert s.streamed_groups == [f"blocks.{i}" for i in range(len(model.blocks))]
        assert s.prefetch_hits + s.prefetch_misses == 4 * len(model.blocks)
        assert (s.prefetch_hits > 0) == (prefetch > 0)  # later forwards found their groups copied ahead
        assert counters()[1] == pageable and dev.copies >= 6  # every copy came from pinned memory
        handle.remove()
    assert identity_map(model) == ids


@pytest.mark.accelerator
def test_a_transformers_model_streams_exactly(accelerator: torch.device) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    ).eval()
    reference = copy.deepcopy(model).to(accelerator)
    ids = torch.tensor([[3, 7, 1, 9]], device=accelerator)
    with tuned(accelerator, seed=2), torch.no_grad():
        expected = reference(ids).logits
        handle = offload(model, accelerator, **stream_all(model, 2))
        assert len(handle.stats().streamed_groups) >= 3
        for _ in range(3):
            exact(model(ids).logits, expected)
        handle.remove()


@pytest.mark.accelerator
def test_groups_run_out_of_the_recorded_order_are_brought_in_exactly(accelerator: torch.device) -> None:
    model = Blocks([8, 16, 8, 16, 8])
    reference = copy.deepcopy(model).to(accelerator)
    x = X.to(accelerator)
    orders = [None, None, [4, 3, 2, 1, 0], [0, 2, 1, 2, 4], [1], None, [3, 3, 3, 0]]
    with tuned(accelerator, seed=4, delay=(0.0, 0.002)), torch.no_grad():
        handle = offload(model, accelerator, **stream_all(model, 2))
        for order in orders:  # reversed, a block run twice, a single block, back to the recorded order
            model.order = reference.order = order
            exact(model(x), reference(x))
        assert handle.stats().prefetch_misses > 5
        handle.remove()


@pytest.mark.accelerator
def test_training_through_streamed_groups_matches_the_resident_model(accelerator: torch.device) -> None:
    model = Blocks([8, 16, 8, 16])
    reference = copy.deepcopy(model).to(accelerator)
    x, y = X.to(accelerator), torch.randn(3, 16, device=accelerator)
    with tuned(accelerator, seed=5):
        handle = offload(model, accelerator, **stream_all(model, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for _ in range(3):
            for m, o in ((model, opt), (reference, ref_opt)):
                o.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
            with torch.no_grad():  # through the ring: the copies carry the updated weights
                exact(model(x), reference(x))
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            exact(a, b)
        handle.remove()


@pytest.mark.accelerator
@pytest.mark.parametrize("storage_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-storage"])
def test_a_model_streamed_to_a_device_compiles_once_with_fullgraph(accelerator: torch.device, storage_dtype: torch.dtype | None) -> None:
    from torch._dynamo.utils import counters as dynamo_counters

    model = Blocks([8, 16] * 4)  # groups enough that the ring's 3 slots hold less than the model
    x = X.to(accelerator)
    try:
        with tuned(accelerator, seed=3), torch.no_grad():
            handle = offload(
                model, accelerator, dtype=torch.float32, storage_dtype=storage_dtype, skip=None,
                **stream_all(model, 2, storage_dtype=storage_dtype or torch.float32),
            )
            eager = model(x)
            assert handle.stats().resident_groups == []  # every group streams
            torch._dynamo.reset()
            dynamo_counters.clear()
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a transfer outside the graph would raise
            with torch._dynamo.config.patch(error_on_recompile=True):
                runs = [compiled(x) for _ in range(3)]
            assert dynamo_counters["stats"]["unique_graphs"] == 1
            for run in runs:
                exact(run, eager)
            exact(model(x), eager)  # eager again: through the ring
            handle.remove()
    finally:
        torch._dynamo.reset()


def _rounded_to(model: nn.Module, dtype: torch.dtype | None) -> None:
    """The values an offload stores ``model``'s weights with (``dtype``), in the plain model."""
    if dtype is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype))


@pytest.mark.accelerator
@pytest.mark.parametrize("storage_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-storage"])
@pytest.mark.parametrize("prefetch", [1, 3, 7])
def test_groups_kept_in_the_ring_are_copied_again_when_their_host_weights_change(
    accelerator: torch.device, prefetch: int, storage_dtype: torch.dtype | None
) -> None:
    # forwards run 4 groups: a ring of prefetch + 1 slots keeps none (prefetch 1) or all (prefetch
    # 3, 7) of them from one forward to the next: optimizer steps, in-place edits and loads
    # between forwards must reach those slots, and a forward after no change must copy nothing
    # more. The model has more groups, which never run: streaming, its slots and casts take
    # less than the whole model, so the budget streams every group rather than keeping it whole
    model = Blocks([8, 16, 8, 16] + [16] * (prefetch + 3))
    model.order = [0, 1, 2, 3]
    _rounded_to(model, storage_dtype)
    reference = copy.deepcopy(model).to(accelerator)
    x, y = X.to(accelerator), torch.randn(3, 16, device=accelerator)
    dev = Watched(accelerator)
    with late(accelerator):
        handle = offload(
            model, dev, dtype=torch.float32, storage_dtype=storage_dtype, skip=None,
            **stream_all(model, prefetch, storage_dtype=storage_dtype or torch.float32),
        )
        assert handle.stats().resident_groups == []  # every group streams
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]

        def forward_matches() -> None:
            with torch.no_grad():
                exact(model(x), reference(x))

        forward_matches()
        assert handle.stats().resident_groups == []  # still, after the first forward's measurements
        for step in range(2):
            for m, o in zip((model, reference), optimizers, strict=True):  # with gradients: beside the ring
                o.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
            _rounded_to(reference, storage_dtype)
            forward_matches()
            with torch.no_grad():
                for m in (model, reference):
                    m.blocks[step][0].weight[1:3] = 0.25  # an edit through a view
                    m.blocks[3 - step][2].bias.mul_(-1)
            forward_matches()
        torchsurgery.load_(model, reference.state_dict())  # bytes written straight into memory
        forward_matches()
        copies = dev.copies
        forward_matches()
        again = dev.copies - copies
        forward_matches()
        assert dev.copies - copies == 2 * again  # no change: the same copies as any forward
        assert again == (0 if prefetch + 1 >= 4 else again)  # every group kept in the ring: none
        handle.remove()


@pytest.mark.parametrize(
    "widths", [[4, 4, 4, 4, 256, 256, 256], [4, 128, 4, 4, 256, 256, 256], [64, 4, 256, 4, 256, 4, 256]]
)
def test_the_planner_runs_on_the_test_devices_timings(on_tardy: torch.device, widths: list[int]) -> None:
    model = Blocks(widths)
    reference = copy.deepcopy(model).to(on_tardy)
    x = X.to(on_tardy)
    sizes = [sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks]
    granule = AcceleratorDevice(on_tardy).allocation_granule  # each group's buffer as the device rounds it
    held = [-(-n // granule) * granule for n in sizes]
    budget = 3 * max(held) + 2 * min(held)  # two groups in flight and one large resident, or small ones
    assert budget < sum(held)  # the model does not fit whole
    # bytes per second: every copy takes as long as a large group's over this link, about 8 ms,
    # far more than any group's compute even on a loaded machine, so streaming them stalls
    # whatever the host's speed
    link = 4e6
    with tardy.settings(seed=6, **slow_link(widths, link)), torch.no_grad():
        handle = offload(model, on_tardy, budget=budget, prefetch=1)
        exact(model(x), reference(x))  # the first forward measures; the planner then chooses
        s = handle.stats()
        costs, bandwidth = s.group_costs, s.link_bytes_per_s  # the timings the planner read, through the seam
        assert [c.name for c in costs] == [f"blocks.{i}" for i in range(len(widths))]
        chosen = s.resident_groups
        # the planner counts the device bytes as the plan counts the budget: resident groups
        # next to the ring (aligned slots for the groups still streaming) and a run's casts
        plan = handle.plan
        fits = lambda keep: plan.device_bytes(set(keep)) <= budget  # noqa: E731
        assert chosen == plan_residency(costs, budget, bandwidth, 1, fits=fits) and chosen
        # (the simulated link also bounded the bandwidth read from above: every copy took at least
        # its bytes over the link's speed. The test device gives no such bound: a copy the host
        # waits for before the stream's worker has started it runs at once, without its delay)
        assert bandwidth > 0
        s = handle.stats()
        streamed = [n for i, n in enumerate(sizes) if f"blocks.{i}" not in chosen]
        assert s.resident_bytes + 2 * max(streamed) <= budget
        assert s.bytes_moved >= sum(streamed) and s.achieved_gbps == pytest.approx(s.bytes_moved / s.seconds_transferring / 1e9)
        ours = simulate(costs, chosen, bandwidth)[1]
        filled = simulate(costs, in_order(costs, budget, 1), bandwidth)[1]
        # the best choice the offload can afford: its slots are aligned, so the plain count (in
        # which all three large groups fit resident beside two small slots) may not fit
        # (where the machine is so loaded that a group's compute outlasts its copy, neither choice
        # stalls at all: both are then the best)
        assert (ours < filled or ours == filled == 0) and ours <= 1.10 * best_stall(costs, budget, bandwidth, 1, fits=fits)
        for _ in range(2):
            exact(model(x), reference(x))
        handle.remove()


@pytest.mark.accelerator
def test_streaming_from_a_safetensors_file_through_the_staging_buffer(accelerator: torch.device, tmp_path: Any) -> None:
    from safetensors.torch import save_file

    widths = [8, 16, 32, 8, 16, 32, 8, 16]  # groups enough that the ring's 3 slots hold less than the model
    reference = Blocks(widths)
    path = tmp_path / "blocks.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path)
    with torchsurgery.skeleton():
        model = Blocks(widths)
    resident = copy.deepcopy(reference).to(accelerator)
    x = X.to(accelerator)
    for lazy in (False, True):
        with tuned(accelerator, seed=7, lazy=lazy), torch.no_grad():
            _, pageable = counters()
            handle = offload(model, accelerator, storage=path, **stream_all(reference, 2))
            assert all(stored_values(p).is_meta for p in model.parameters())  # the weights stay in the file
            for _ in range(3):
                exact(model(x), resident(x))
            assert {p.residency for p in handle.plan.params} == {Residency.FILE}
            assert counters()[1] == pageable and handle.stats().prefetch_hits > 0  # staged through pinned memory
            handle.remove()
    assert all(p.is_meta for p in model.parameters())


def test_groups_made_resident_by_the_planner_are_read_from_the_safetensors_file(
    on_tardy: torch.device, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import save_file

    widths = [8, 16, 32, 8, 16]
    reference = Blocks(widths)
    path = tmp_path / "blocks.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path)
    with torchsurgery.skeleton():
        model = Blocks(widths)
    resident = copy.deepcopy(reference).to(on_tardy)
    x = X.to(on_tardy)
    total = sum(p.numel() * 4 for p in reference.parameters())
    # every streamed group stalls, as measured from a controlled source (a group computes in a
    # microsecond, the link moves a kilobyte a second), so the planner keeps what fits resident
    # on any machine; the copies themselves still land late
    with tardy.settings(seed=3, **slow_link(widths, 4e5)), torch.no_grad():
        handle = offload(model, on_tardy, storage=path, budget=total - 1, prefetch=1)
        streaming = handle._streaming
        sizes = {name: packed.layout.nbytes for name, packed in streaming.packed.items()}
        monkeypatch.setattr(streaming, "measured", lambda names: ([GroupCost(n, sizes[n], 1e-6) for n in names if n in sizes], 1e3))
        for _ in range(3):
            exact(model(x), resident(x))
        assert handle.stats().resident_groups  # made resident after the first forward, from the file
        handle.remove()
    assert all(p.is_meta for p in model.parameters())  # back to the skeleton it was


class _Stop(Exception):
    pass


def _stop(*args: Any) -> None:
    raise _Stop


def test_remove_with_copies_in_flight_waits_for_them_and_restores_the_model(on_tardy: torch.device) -> None:
    model = Blocks([8, 16, 8, 16, 8, 16, 8, 16])
    reference = copy.deepcopy(model)
    ids = identity_map(model)
    x = X.to(on_tardy)
    with tardy.settings(lazy=True), torch.no_grad():
        handle = offload(model, on_tardy, **stream_all(model, 2))
        model(x)
        hook = model.blocks[4].register_forward_pre_hook(_stop)
        with pytest.raises(_Stop):
            model(x)  # block 3 ran and asked for blocks 4 and 5 ahead: those copies are in flight
        hook.remove()
        assert tardy.in_flight() > 0
        handle.remove()
        assert tardy.in_flight() == 0
    assert identity_map(model) == ids
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        exact(a, b)
    exact(model(X), reference(X))


@pytest.mark.accelerator
def test_an_exception_in_a_forward_with_copies_in_flight_leaves_streaming_exact(accelerator: torch.device) -> None:
    model = Blocks([8, 16, 8, 16, 8])
    reference = copy.deepcopy(model).to(accelerator)
    x = X.to(accelerator)
    with tuned(accelerator, seed=8, delay=(0.0, 0.002)), torch.no_grad():
        handle = offload(model, accelerator, **stream_all(model, 2))
        exact(model(x), reference(x))
        hook = model.blocks[2][0].register_forward_hook(_stop)  # inside a streamed group
        with pytest.raises(_Stop):
            model(x)
        hook.remove()
        assert all(isinstance(p, nn.Parameter) for p in model.parameters())
        for _ in range(3):
            hits = handle.stats().prefetch_hits
            exact(model(x), reference(x))
        assert handle.stats().prefetch_hits == hits + 4  # prefetching goes on: every block after the first was ahead
        handle.remove()


# ---------------------------------------------------------------------- streaming on the accelerator
#
# The machine's own accelerator, or the suite's test device (tests/tardy): there the engine
# runs through AcceleratorDevice with real streams, events and pinned memory, copies land
# late into poisoned memory, and a use of memory another stream touched without an event
# in between raises.


@pytest.mark.accelerator
@pytest.mark.parametrize("lazy", [False, True], ids=["random-delays", "lazy"])
@pytest.mark.parametrize("pin_memory", [True, False], ids=["pinned", "pageable"])
def test_streaming_on_the_accelerator_is_exact_while_copies_land_late(accelerator: torch.device, pin_memory: bool, lazy: bool) -> None:
    model = Blocks([8, 32, 8, 32, 16, 8])
    resident = copy.deepcopy(model).to(accelerator)
    x = X.to(accelerator)
    ids = identity_map(model)
    with late(accelerator) if lazy else contextlib.nullcontext(), torch.no_grad():
        expected = resident(x)
        pageable = tardy.pageable_copies() if tardy.registered() else 0
        handle = offload(model, accelerator, skip=None, pin_memory=pin_memory, **stream_all(model, 2))
        for _ in range(4):
            exact(model(x), expected)
        assert handle.stats().prefetch_hits > 0
        if tardy.registered():  # the host buffers are pinned, or the copies came from pageable memory
            assert (tardy.pageable_copies() > pageable) != pin_memory
        handle.remove()
    assert identity_map(model) == ids


@pytest.mark.accelerator
def test_remove_on_the_accelerator_lets_the_copies_in_flight_land_first(accelerator: torch.device) -> None:
    model = Blocks([8, 16, 8, 16, 8, 16, 8, 16])
    reference = copy.deepcopy(model)
    ids = identity_map(model)
    x = X.to(accelerator)
    with late(accelerator), torch.no_grad():
        handle = offload(model, accelerator, **stream_all(model, 2))
        model(x)
        hook = model.blocks[4].register_forward_pre_hook(_stop)
        with pytest.raises(_Stop):
            model(x)  # block 3 ran and asked for blocks 4 and 5 ahead: those copies are in flight
        hook.remove()
        handle.remove()  # the ring's buffers go: what is copied into them must have landed
        assert not tardy.registered() or tardy.in_flight() == 0
    assert identity_map(model) == ids
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        exact(a, b)


def test_the_planner_remaking_the_ring_lets_the_copies_in_flight_land_first(on_tardy: torch.device) -> None:
    # a forward that stops early leaves the groups copied ahead for it unrun, their copies still
    # writing into the ring's slots when the planner (after that forward) frees the ring, makes
    # groups resident and makes a new ring: the old buffers may go only once those copies have
    # landed. The test device reports memory freed while a copy into it is unordered with the
    # host as a hazard, whatever the timing
    model = Blocks([8, 16, 8, 16, 8, 16, 8, 16])
    resident = copy.deepcopy(model).to(on_tardy)
    x = X.to(on_tardy)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    with tardy.settings(delay=(0.01, 0.012)):  # slow copies: the planner keeps what fits resident
        handle = offload(model, on_tardy, budget=total - 1, prefetch=2)
        model(x).sum().backward()  # a training step records the order (beside the ring: no planning)
        with torch.no_grad():
            model.order = resident.order = [0, 1, 2, 3]  # block 3 asks for blocks 4 and 5 ahead: not run
            exact(model(x), resident(x))
            assert handle.stats().resident_groups  # the planner remade the ring after that forward
            model.order = resident.order = None
            for _ in range(2):
                exact(model(x), resident(x))
        handle.remove()


@pytest.mark.accelerator
def test_writes_through_data_or_a_view_reach_the_groups_kept_in_the_ring(accelerator: torch.device) -> None:
    # the ring's 4 slots keep the 4 groups a forward runs from one forward to the next. A
    # streamed weight reads as a tensor on the device and keeps its values in host memory: a
    # write that goes around the weight (through .data, or a view of it) counts in the stored
    # values' version only, and must still have the next forward copy the group in again
    model = Blocks([8, 16, 8, 16] + [16] * 6)
    model.order = [0, 1, 2, 3]
    resident = copy.deepcopy(model).to(accelerator)
    x = X.to(accelerator)
    edits: list[Any] = [
        lambda m: m.blocks[0][0].weight.data.mul_(2),
        lambda m: m.blocks[1][2].weight.detach()[0].zero_(),
        lambda m: m.blocks[2][0].weight[:1].fill_(0.25),
        lambda m: m.blocks[3][2].bias.data[1:3].neg_(),
    ]
    with late(accelerator), torch.no_grad():
        handle = offload(model, accelerator, skip=None, **stream_all(model, 3))
        exact(model(x), resident(x))
        copies = tardy.copies() if tardy.registered() else 0
        exact(model(x), resident(x))
        assert not tardy.registered() or tardy.copies() == copies  # every group kept in the ring
        for edit in edits:
            for m in (model, resident):
                edit(m)
            exact(model(x), resident(x))
        handle.remove()


def test_a_forward_with_gradients_issues_each_groups_copies_without_waiting_for_them(on_tardy: torch.device) -> None:
    # speed, seen without timing: a forward that records gradients copies each group's weights
    # from pinned memory on the compute stream as the group starts; the host must not wait for
    # them (it goes on to enqueue the group's compute, the device runs the copies first). On
    # the lazy test device a copy the host did not wait for is still in flight then
    model = Blocks([8, 16, 8, 16, 8, 16])
    resident = copy.deepcopy(model).to(on_tardy)
    x = X.to(on_tardy)
    seen: list[list[tardy.Copy]] = []
    with tardy.settings(lazy=True):
        handle = offload(model, on_tardy, skip=None, **stream_all(model, 1))
        hooks = [b[0].register_forward_pre_hook(lambda *_: seen.append(logged())) for b in model.blocks]
        with tardy.copy_log() as logged:
            out = model(x)
        exact(out, resident(x))
        out.sum().backward()
        for hook in hooks:
            hook.remove()
        handle.remove()
    assert len(seen) == len(model.blocks)
    for before, now in zip([[]] + seen, seen, strict=False):
        issued = now[len(before):]  # the copies that brought this group in
        assert issued and all(c.to_device and c.asynchronous and not c.landed for c in issued), issued


def test_groups_come_in_on_the_side_stream_while_the_group_before_computes(on_tardy: torch.device) -> None:
    # speed, seen without timing: in a forward without gradients every copy into the ring runs
    # on the side stream, and the next group's copy is issued before this group's compute and
    # not ordered before it, so the two may overlap. On the lazy test device a copy nothing
    # waited for is still in flight when the group before it has computed
    model = Blocks([8, 16, 8, 16, 8, 16])
    resident = copy.deepcopy(model).to(on_tardy)
    x = X.to(on_tardy)
    after: list[list[tardy.Copy]] = []
    with tardy.settings(lazy=True), torch.no_grad():
        expected = resident(x)
        handle = offload(model, on_tardy, skip=None, **stream_all(model, 1))
        exact(model(x), expected)  # records the order
        hooks = [b.register_forward_hook(lambda *_: after.append(logged())) for b in model.blocks]
        with tardy.copy_log() as logged:
            exact(model(x), expected)
            copies = logged()
        for hook in hooks:
            hook.remove()
        handle.remove()
    compute = torch.accelerator.current_stream().stream_id
    assert copies and all(c.to_device and c.asynchronous and c.stream != compute for c in copies), copies
    assert len({c.stream for c in copies}) == 1  # the ring's side stream
    # every group but the last had the next one's copy in flight as it finished (the first
    # may find the second still in the ring from the forward before)
    assert sum(any(not c.landed for c in seen) for seen in after) >= len(model.blocks) - 2, after


@pytest.mark.accelerator
def test_streaming_from_a_safetensors_file_on_the_accelerator_through_the_staging_buffer(
    accelerator: torch.device, tmp_path: Any
) -> None:
    from safetensors.torch import save_file

    reference = Blocks([8, 16, 32, 8, 16])
    path = tmp_path / "blocks.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path)
    with torchsurgery.skeleton():
        model = Blocks([8, 16, 32, 8, 16])
    resident = copy.deepcopy(reference).to(accelerator)
    x = X.to(accelerator)
    with late(accelerator), torch.no_grad():
        handle = offload(model, accelerator, storage=path, **stream_all(reference, 2))
        for _ in range(3):  # the staging buffer is refilled only once its last copy has read it
            exact(model(x), resident(x))
        handle.remove()
    assert all(p.is_meta for p in model.parameters())


# ---------------------------------------------------------------------- the suite catches ordering mistakes


def _stream_and_compare(dev: Watched, reference: Blocks, path: Any) -> bool:
    """Whether the streaming engine gives exact results on ``dev`` and leaves nothing in flight."""
    model = copy.deepcopy(reference)
    with torchsurgery.skeleton():
        from_file = Blocks([len(b[0].bias) for b in reference.blocks])
    x = X.to(dev.device)
    expected = copy.deepcopy(reference).to(dev.device)(x)
    with torch.no_grad():
        for m, kwargs in ((model, stream_all(reference, 1)), (from_file, {**stream_all(reference, 2), "storage": path})):
            handle = offload(m, dev, **kwargs)  # type: ignore[arg-type]
            for _ in range(3):
                if not torch.equal(m(x), expected):
                    return False
            hook = m.blocks[4].register_forward_pre_hook(_stop)
            with pytest.raises(_Stop):
                m(x)  # copies in flight when remove() comes
            hook.remove()
            handle.remove()
            if tardy.in_flight() != 0:
                return False
    return True


def _streams_correctly(dev: Watched, reference: Blocks, path: Any) -> bool:
    """:func:`_stream_and_compare`, and no hazard: neither a use of memory another stream touched
    without an event in between (raised at once) nor memory freed while a copy into it was in flight."""
    try:
        correct = _stream_and_compare(dev, reference, path)
    except RuntimeError as error:
        if "tardy: hazard" not in str(error):
            raise
        correct = False
    gc.collect()  # what a failed run left offloaded lets go of its buffers now
    with contextlib.suppress(RuntimeError):  # a hazard found as they go is reported here
        torch.accelerator.synchronize()
    found = tardy.hazards()
    return correct and not found


def test_dropping_any_wait_record_or_synchronize_of_the_engine_is_caught(on_tardy: torch.device, tmp_path: Any) -> None:
    from safetensors.torch import save_file

    reference = Blocks([8, 16, 8, 16, 8, 16, 8, 16])  # more groups than slots: several copies in flight
    path = tmp_path / "blocks.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path)
    with tardy.settings(lazy=True):
        clean = Watched(on_tardy)
        assert _streams_correctly(clean, reference, path)
        # the engine's ordering operations: every wait and synchronize, and the records whose
        # events something waits on (the others only time)
        sites = sorted(site for site in clean.sites if site[0] != "record" or site[1] in clean.ordering)
        assert {op for op, _ in sites} == {"wait", "record", "synchronize"} and len(sites) >= 5, sites
        for site in sites:
            assert not _streams_correctly(Watched(on_tardy, drop=site), reference, path), f"dropping {site} went unnoticed"
