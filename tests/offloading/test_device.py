"""The device seam, and the streaming engine run on a simulated asynchronous device.

On a CPU every copy is synchronous, so an ordering mistake in the streaming engine cannot
show. ``simulated_device.SimulatedDevice`` makes copies land late on worker threads, with
poison in their destinations until then, and refuses copies that would overwrite a buffer
the computations may still read; everything here runs the engine on it and compares with
the resident model.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
from _residency import best_stall, in_order
from simulated_device import POISON, Hazard, SimulatedDevice
from torch import nn

import tardy
import torchsurgery
from torchsurgery import Residency, offload
from torchsurgery.offloading.device import AcceleratorDevice, resolve_device
from torchsurgery.offloading.residency import plan_residency, simulate


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
    accelerator, whose allocations count at least what the simulated device counts). A model
    smaller than that is kept whole: it needs groups of similar size, more than ``prefetch + 1``
    of them (more still where a run casts its weights).
    """
    device = device if device is not None else torch.accelerator.current_accelerator()
    assert device is not None
    with pytest.raises(torchsurgery.BudgetError) as refused:
        torchsurgery.plan_offload(model, device, budget=1, prefetch=prefetch, storage_dtype=storage_dtype)
    return {"prefetch": prefetch, "budget": refused.value.needed}


X = torch.linspace(-1, 1, 3 * 16).reshape(3, 16)


# ---------------------------------------------------------------------- the simulator itself


def test_the_simulated_device_keeps_cudas_ordering_rules() -> None:
    with SimulatedDevice(lazy=True) as sim:
        compute, a, b = sim.current_stream(), sim.new_stream(), sim.new_stream()
        host = sim.pin(torch.arange(8, dtype=torch.uint8))
        x, y = sim.empty(8), sim.empty(8)
        sim.copy_(x, host, a)
        assert (x == POISON).all()  # not waited for: poison
        sim.wait(b, sim.record(a))  # b's work runs after a's copy
        sim.copy_(y, x, b)
        sim.wait(compute, sim.record(b))
        assert torch.equal(y, host) and torch.equal(x, host)
        sim.wait(a, sim.record(compute))  # a's next copies come after those reads
        sim.copy_(x, host, a)
        host.fill_(7)  # refilled before the copy landed: the copy moves the new bytes
        sim.synchronize(a)
        assert (x == 7).all()
        sim.wait(a, sim.record(compute))
        sim.copy_(x, torch.zeros(8, dtype=torch.uint8), a)  # pageable memory: synchronous
        assert (x == 0).all() and sim.unpinned_copies == 1
        x.sum()  # a computation reads x ...
        with pytest.raises(Hazard):  # ... so a copy into x must wait for an event after it
            sim.copy_(x, host, a)
        sim.wait(a, sim.record(compute))
        sim.copy_(x, host, a)
        assert not sim.idle()
        sim.synchronize()
        assert sim.idle() and (x == 7).all()
    with SimulatedDevice(delay=(0.0, 0.003), seed=1) as sim:  # in order per stream, whatever the delays
        side, z = sim.new_stream(), sim.empty(4)
        for value in range(20):
            sim.copy_(z, sim.pin(torch.full((4,), value, dtype=torch.uint8)), side)
        start = sim.record(side)
        sim.synchronize(side)
        assert (z == 19).all() and isinstance(sim.elapsed(start, sim.record(side)), float)


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


# ---------------------------------------------------------------------- streaming on the simulated device


@pytest.mark.parametrize("lazy", [False, True], ids=["random-delays", "lazy"])
@pytest.mark.parametrize("storage_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-storage"])
@pytest.mark.parametrize("prefetch", [0, 1, 2, 3, 7])
def test_streamed_forwards_match_the_resident_model(prefetch: int, storage_dtype: torch.dtype | None, lazy: bool) -> None:
    # two largest groups: neither can be resident; enough others that prefetch + 1 slots hold less than the model
    model = Blocks([8, 32, 8, 32, 16, 8] + [16, 24] * prefetch)
    reference = copy.deepcopy(model)
    if storage_dtype is not None:
        with torch.no_grad():
            for p in reference.parameters():
                p.copy_(p.to(storage_dtype))
    ids = identity_map(model)
    with SimulatedDevice(seed=prefetch, delay=(0.0, 0.002), lazy=lazy) as sim, torch.no_grad():
        expected = reference(X)
        handle = offload(
            model, sim, dtype=torch.float32, storage_dtype=storage_dtype, skip=None,
            **stream_all(model, prefetch, storage_dtype=storage_dtype or torch.float32, device=sim),
        )
        assert {p.residency for p in handle.plan.params} == {Residency.STREAMED}  # every group rides the ring
        for _ in range(4):
            exact(model(X), expected)
        s = handle.stats()
        assert s.streamed_groups == [f"blocks.{i}" for i in range(len(model.blocks))]
        assert s.prefetch_hits + s.prefetch_misses == 4 * len(model.blocks)
        assert (s.prefetch_hits > 0) == (prefetch > 0)  # later forwards found their groups copied ahead
        assert sim.unpinned_copies == 0 and sim.copies >= 6  # every copy came from pinned memory
        handle.remove()
    assert identity_map(model) == ids


def test_a_transformers_model_streams_exactly() -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    ).eval()
    reference = copy.deepcopy(model)
    ids = torch.tensor([[3, 7, 1, 9]])
    with SimulatedDevice(seed=2) as sim, torch.no_grad():
        expected = reference(ids).logits
        handle = offload(model, sim, **stream_all(model, 2))
        assert len(handle.stats().streamed_groups) >= 3
        for _ in range(3):
            exact(model(ids).logits, expected)
        handle.remove()


def test_groups_run_out_of_the_recorded_order_are_brought_in_exactly() -> None:
    model = Blocks([8, 16, 8, 16, 8])
    reference = copy.deepcopy(model)
    orders = [None, None, [4, 3, 2, 1, 0], [0, 2, 1, 2, 4], [1], None, [3, 3, 3, 0]]
    with SimulatedDevice(seed=4, delay=(0.0, 0.002)) as sim, torch.no_grad():
        handle = offload(model, sim, **stream_all(model, 2))
        for order in orders:  # reversed, a block run twice, a single block, back to the recorded order
            model.order = reference.order = order
            exact(model(X), reference(X))
        assert handle.stats().prefetch_misses > 5
        handle.remove()


def test_training_through_streamed_groups_matches_the_resident_model() -> None:
    model = Blocks([8, 16, 8, 16])
    reference = copy.deepcopy(model)
    y = torch.randn(3, 16)
    with SimulatedDevice(seed=5) as sim:
        handle = offload(model, sim, **stream_all(model, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for _ in range(3):
            for m, o in ((model, opt), (reference, ref_opt)):
                o.zero_grad()
                nn.functional.mse_loss(m(X), y).backward()
                o.step()
            with torch.no_grad():  # through the ring: the copies carry the updated weights
                exact(model(X), reference(X))
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            exact(a, b)
        handle.remove()


@pytest.mark.parametrize("storage_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-storage"])
def test_a_model_streamed_to_a_device_compiles_once_with_fullgraph(storage_dtype: torch.dtype | None) -> None:
    from torch._dynamo.utils import counters

    model = Blocks([8, 16] * 4)  # groups enough that the ring's 3 slots hold less than the model
    # not entered as a context: its read-tracking dispatch mode would keep Dynamo out
    sim = SimulatedDevice(seed=3)
    try:
        with torch.no_grad():
            handle = offload(
                model, sim, dtype=torch.float32, storage_dtype=storage_dtype, skip=None,
                **stream_all(model, 2, storage_dtype=storage_dtype or torch.float32, device=sim),
            )
            eager = model(X)
            assert handle.stats().resident_groups == []  # every group streams
            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a transfer outside the graph would raise
            with torch._dynamo.config.patch(error_on_recompile=True):
                runs = [compiled(X) for _ in range(3)]
            assert counters["stats"]["unique_graphs"] == 1
            for run in runs:
                exact(run, eager)
            exact(model(X), eager)  # eager again: through the ring
            handle.remove()
    finally:
        sim.close()
        torch._dynamo.reset()


def _rounded_to(model: nn.Module, dtype: torch.dtype | None) -> None:
    """The values an offload stores ``model``'s weights with (``dtype``), in the plain model."""
    if dtype is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype))


@pytest.mark.parametrize("storage_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-storage"])
@pytest.mark.parametrize("prefetch", [1, 3, 7])
def test_groups_kept_in_the_ring_are_copied_again_when_their_host_weights_change(
    prefetch: int, storage_dtype: torch.dtype | None
) -> None:
    # forwards run 4 groups: a ring of prefetch + 1 slots keeps none (prefetch 1) or all (prefetch
    # 3, 7) of them from one forward to the next: optimizer steps, in-place edits and loads
    # between forwards must reach those slots, and a forward after no change must copy nothing
    # more. The model has more groups, which never run: streaming, its slots and casts take
    # less than the whole model, so the budget streams every group rather than keeping it whole
    model = Blocks([8, 16, 8, 16] + [16] * (prefetch + 3))
    model.order = [0, 1, 2, 3]
    _rounded_to(model, storage_dtype)
    reference = copy.deepcopy(model)
    y = torch.randn(3, 16)
    with SimulatedDevice(seed=prefetch, lazy=True) as sim:
        handle = offload(
            model, sim, dtype=torch.float32, storage_dtype=storage_dtype, skip=None,
            **stream_all(model, prefetch, storage_dtype=storage_dtype or torch.float32, device=sim),
        )
        assert handle.stats().resident_groups == []  # every group streams
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]

        def forward_matches() -> None:
            with torch.no_grad():
                exact(model(X), reference(X))

        forward_matches()
        assert handle.stats().resident_groups == []  # still, after the first forward's measurements
        for step in range(2):
            for m, o in zip((model, reference), optimizers, strict=True):  # with gradients: beside the ring
                o.zero_grad()
                nn.functional.mse_loss(m(X), y).backward()
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
        copies = sim.copies
        forward_matches()
        again = sim.copies - copies
        forward_matches()
        assert sim.copies - copies == 2 * again  # no change: the same copies as any forward
        assert again == (0 if prefetch + 1 >= 4 else again)  # every group kept in the ring: none
        handle.remove()


@pytest.mark.parametrize(
    "widths", [[4, 4, 4, 4, 256, 256, 256], [4, 128, 4, 4, 256, 256, 256], [64, 4, 256, 4, 256, 4, 256]]
)
def test_the_planner_runs_on_the_simulated_links_timings(widths: list[int]) -> None:
    model = Blocks(widths)
    reference = copy.deepcopy(model)
    sizes = [sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks]
    budget = 3 * max(sizes) + 2 * min(sizes)  # two groups in flight and one large resident, or small ones
    assert budget < sum(sizes)
    # bytes per second: a large group's copy takes about 8 ms, far more than any group's
    # compute even on a loaded machine, so streaming them stalls whatever the host's speed
    link = 4e6
    with SimulatedDevice(seed=6, delay=(0.0, 1e-4), bandwidth=link) as sim, torch.no_grad():
        handle = offload(model, sim, budget=budget, prefetch=1)
        exact(model(X), reference(X))  # the first forward measures; the planner then chooses
        s = handle.stats()
        costs, bandwidth = s.group_costs, s.link_bytes_per_s  # the timings the planner read, through the seam
        assert [c.name for c in costs] == [f"blocks.{i}" for i in range(len(widths))]
        chosen = s.resident_groups
        # the planner counts the device bytes as the plan counts the budget: resident groups
        # next to the ring (aligned slots for the groups still streaming) and a run's casts
        plan = handle.plan
        fits = lambda keep: plan.device_bytes(set(keep)) <= budget  # noqa: E731
        assert chosen == plan_residency(costs, budget, bandwidth, 1, fits=fits) and chosen
        assert bandwidth <= link  # every copy took at least its bytes over the link's speed
        s = handle.stats()
        streamed = [n for i, n in enumerate(sizes) if f"blocks.{i}" not in chosen]
        assert s.resident_bytes + 2 * max(streamed) <= budget
        assert s.bytes_moved >= sum(streamed) and s.achieved_gbps == pytest.approx(s.bytes_moved / s.seconds_transferring / 1e9)
        ours = simulate(costs, chosen, bandwidth)[1]
        filled = simulate(costs, in_order(costs, budget, 1), bandwidth)[1]
        # the best choice the offload can afford: its slots are aligned, so the plain count (in
        # which all three large groups fit resident beside two small slots) may not fit
        assert ours < filled and ours <= 1.10 * best_stall(costs, budget, bandwidth, 1, fits=fits)
        for _ in range(2):
            exact(model(X), reference(X))
        handle.remove()


def test_streaming_from_a_safetensors_file_through_the_staging_buffer(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    widths = [8, 16, 32, 8, 16, 32, 8, 16]  # groups enough that the ring's 3 slots hold less than the model
    reference = Blocks(widths)
    path = tmp_path / "blocks.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path)
    with torchsurgery.skeleton():
        model = Blocks(widths)
    for lazy in (False, True):
        with SimulatedDevice(seed=7, lazy=lazy) as sim, torch.no_grad():
            handle = offload(model, sim, storage=path, **stream_all(reference, 2, device=sim))
            assert all(p.is_meta for p in model.parameters())  # the weights stay in the file
            for _ in range(3):
                exact(model(X), reference(X))
            assert {p.residency for p in handle.plan.params} == {Residency.FILE}
            assert sim.unpinned_copies == 0 and handle.stats().prefetch_hits > 0  # staged through pinned memory
            handle.remove()
    assert all(p.is_meta for p in model.parameters())


def test_groups_made_resident_by_the_planner_are_read_from_the_safetensors_file(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    reference = Blocks([8, 16, 32, 8, 16])
    path = tmp_path / "blocks.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path)
    with torchsurgery.skeleton():
        model = Blocks([8, 16, 32, 8, 16])
    total = sum(p.numel() * 4 for p in reference.parameters())
    # a slow link: every streamed group stalls, so the planner keeps what fits resident
    with SimulatedDevice(seed=3, delay=(0.0, 1e-4), bandwidth=4e6) as sim, torch.no_grad():
        handle = offload(model, sim, storage=path, budget=total - 1, prefetch=1)
        for _ in range(3):
            exact(model(X), reference(X))
        assert handle.stats().resident_groups  # made resident after the first forward, from the file
        handle.remove()
    assert all(p.is_meta for p in model.parameters())  # back to the skeleton it was


class _Stop(Exception):
    pass


def _stop(*args: Any) -> None:
    raise _Stop


def test_remove_with_copies_in_flight_waits_for_them_and_restores_the_model() -> None:
    model = Blocks([8, 16, 8, 16, 8, 16, 8, 16])
    reference = copy.deepcopy(model)
    ids = identity_map(model)
    with SimulatedDevice(lazy=True) as sim, torch.no_grad():
        handle = offload(model, sim, **stream_all(model, 2))
        model(X)
        hook = model.blocks[4].register_forward_pre_hook(_stop)
        with pytest.raises(_Stop):
            model(X)  # block 3 ran and asked for blocks 4 and 5 ahead: those copies are in flight
        hook.remove()
        assert not sim.idle()
        handle.remove()
        assert sim.idle()
    assert identity_map(model) == ids
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        exact(a, b)
    exact(model(X), reference(X))


def test_an_exception_in_a_forward_with_copies_in_flight_leaves_streaming_exact() -> None:
    model = Blocks([8, 16, 8, 16, 8])
    reference = copy.deepcopy(model)
    with SimulatedDevice(seed=8, delay=(0.0, 0.002)) as sim, torch.no_grad():
        handle = offload(model, sim, **stream_all(model, 2))
        exact(model(X), reference(X))
        hook = model.blocks[2][0].register_forward_hook(_stop)  # inside a streamed group
        with pytest.raises(_Stop):
            model(X)
        hook.remove()
        assert all(isinstance(p, nn.Parameter) for p in model.parameters())
        for _ in range(3):
            hits = handle.stats().prefetch_hits
            exact(model(X), reference(X))
        assert handle.stats().prefetch_hits == hits + 4  # prefetching goes on: every block after the first was ahead
        handle.remove()


# ---------------------------------------------------------------------- streaming on the accelerator
#
# The machine's own accelerator, or the suite's test device (tests/tardy): there the engine
# runs through AcceleratorDevice with real streams, events and pinned memory, copies land
# late into poisoned memory, and a use of memory another stream touched without an event
# in between raises.


def late(accelerator: torch.device) -> contextlib.AbstractContextManager[Any]:
    """On the test device: copies run only when something waits for them. Elsewhere: as the device is."""
    return tardy.settings(lazy=True) if accelerator.type == tardy.NAME else contextlib.nullcontext()


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


def _streams_correctly(sim: SimulatedDevice, reference: Blocks, path: Any) -> bool:
    """Whether the streaming engine gives exact results on ``sim`` and leaves nothing in flight."""
    model = copy.deepcopy(reference)
    with torchsurgery.skeleton():
        from_file = Blocks([len(b[0].bias) for b in reference.blocks])
    try:
        with torch.no_grad():
            for m, kwargs in ((model, stream_all(reference, 1)), (from_file, {**stream_all(reference, 2), "storage": path})):
                handle = offload(m, sim, **kwargs)  # type: ignore[arg-type]
                for _ in range(3):
                    if not torch.equal(m(X), reference(X)):
                        return False
                hook = m.blocks[4].register_forward_pre_hook(_stop)
                with pytest.raises(_Stop):
                    m(X)  # copies in flight when remove() comes
                hook.remove()
                handle.remove()
                if not sim.idle():
                    return False
    except Hazard:
        return False
    return True


def test_dropping_any_wait_record_or_synchronize_of_the_engine_is_caught(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    reference = Blocks([8, 16, 8, 16, 8, 16, 8, 16])  # more groups than slots: several copies in flight
    path = tmp_path / "blocks.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path)
    with SimulatedDevice(lazy=True) as clean:
        assert _streams_correctly(clean, reference, path)
    # the engine's ordering operations: every wait and synchronize, and the records whose
    # events something waits on (the others only time)
    sites = sorted(
        site for site in clean.sites
        if site[1].startswith(("streams.py", "engine.py")) and (site[0] != "record" or site[1] in clean.ordering)
    )
    assert {op for op, _ in sites} == {"wait", "record", "synchronize"} and len(sites) >= 5, sites
    for site in sites:
        with SimulatedDevice(lazy=True, drop=site) as sim:
            assert not _streams_correctly(sim, reference, path), f"dropping {site} went unnoticed"
