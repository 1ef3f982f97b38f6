"""Scaled weights (``torchsurgery.compact.Scaled``) in streamed groups: through the ring on an
accelerator, through the host ring on a CPU, made resident after the first forward, compiled.

The reference throughout is the plain model whose weights hold the dequantised values
``dequantize(q, scale, dtype)``: on an accelerator a streamed scaled weight is widened into
exactly those values, so the outputs are the plain model's bit for bit; on a CPU its products
scale the sums, as a scaled weight kept whole does, so they equal the kept-whole model's bit
for bit and the plain model's within the rounding of that one reordering.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable

import pytest
import torch
import torch.nn.functional as F
from _offload_models import least_budget, peak_of
from torch import nn

from _scaled_formats import FORMATS, IDS
from torchsurgery import OffloadedTensor, offload
from torchsurgery.compact import Scaled, own_scale, stored_values
from torchsurgery.compact.scaled import dequantize, quantize_with
from torchsurgery.offloading import Residency, measured_residency
from torchsurgery.offloading.budgets import streaming_bytes

D = 32


def _typical(model: nn.Module) -> nn.Module:
    """Weights at a typical scale (std 0.02, where unscaled fp8 is subnormal)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    return model


def blocks(n: int = 4) -> nn.Module:
    return _typical(nn.Sequential(*[nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)) for _ in range(n)]))


class FunctionalLinear(nn.Module):
    """A layer that multiplies by its weight with ``F.linear`` itself: not an ``nn.Linear``, so a CPU streams it."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in))
        self.bias = nn.Parameter(torch.randn(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Block(nn.Module):
    """A product and a convolution, neither of which a CPU reads narrow in place."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = FunctionalLinear(D, D)
        self.conv = nn.Conv1d(1, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x)) + self.conv(x.unsqueeze(1)).mean(1)


def streamed_on_a_cpu(n: int = 4) -> nn.Module:
    return _typical(nn.Sequential(*[Block() for _ in range(n)]))


def dequantised(model: nn.Module, fmt: Scaled, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A plain copy of ``model`` in ``dtype`` whose weights hold the values ``fmt`` keeps (biases keep theirs)."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            if p.dim() >= 2:
                p.copy_(dequantize(*fmt.quantize(p), torch.float32))
    return reference.to(dtype)


def kept_bytes(weights: Iterable[torch.Tensor]) -> int:
    """What ``weights`` keep: each one's stored values, and each scaled one's scale."""
    kept = [(stored_values(w), own_scale(w)) for w in weights]
    return sum(v.nbytes + (0 if s is None else s.nbytes) for v, s in kept)


# ---------------------------------------------------------------------- through the ring on an accelerator


@pytest.mark.accelerator
@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [(f, torch.float32) for f in FORMATS] + [(FORMATS[0], torch.bfloat16), (FORMATS[3], torch.bfloat16)],
    ids=[f"{i}-float32" for i in IDS] + [f"{IDS[0]}-bfloat16", f"{IDS[3]}-bfloat16"],
)
def test_streamed_through_the_ring_a_scaled_weight_is_the_dequantised_weight_bit_for_bit(
    fmt: Scaled, dtype: torch.dtype, accelerator: torch.device, allocation_bytes: Callable[[int], int]
) -> None:
    model = blocks()
    reference = dequantised(model, fmt, dtype).to(accelerator)
    x = torch.randn(3, D, device=accelerator, dtype=dtype)
    budget = least_budget(model, accelerator, storage_dtype=fmt, dtype=dtype)  # every group streams
    with torch.no_grad():
        expected = reference(x)
        activations = peak_of(functools.partial(reference, x))
        del reference
        handle = offload(model, accelerator, storage_dtype=fmt, dtype=dtype, budget=budget)
        assert {p.residency for p in handle.plan.params} == {Residency.STREAMED}
        for _ in range(3):  # the first forward records the order; later ones prefetch along it
            torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
        # besides the ring (allocated already), a forward holds what the plan counts for a run: each
        # weight widened from its slot (bf16 through its fp32 dequantisation), as the allocator counts it
        granule = handle.plan.offload_device.allocation_granule
        per_run = max(streaming_bytes(g, granule)[1] for g in handle.plan.groups)
        rounding = 2 * len(list(model.parameters())) * (allocation_bytes(1) - 1)
        assert peak_of(lambda: model(x)) <= per_run + activations + rounding
    s = handle.stats()
    assert s.streamed_groups == ["0", "1", "2", "3"] and s.peak_device_bytes <= budget
    # each run carries what the model keeps: the weights narrow (one byte a value, a quarter of
    # fp32's bytes, half of bf16's, and one fp32 scale a row of at least D values), the biases as they compute
    assert s.bytes_moved == 4 * kept_bytes(model.parameters())
    weights = [p for p in model.parameters() if p.dim() >= 2]
    values = sum(p.numel() for p in weights)
    assert sum(stored_values(p).nbytes for p in weights) == values
    assert sum(kept_bytes([p]) for p in weights) <= values * (1 + 4 / D)
    weight = model[0][0].weight
    assert isinstance(weight, OffloadedTensor) and weight.device == accelerator
    assert weight.stored.device.type == "cpu" and own_scale(weight).device.type == "cpu"  # type: ignore[union-attr]
    handle.remove()
    for mine, theirs in zip(model.parameters(), dequantised(blocks(), fmt).parameters(), strict=True):
        assert mine.device.type == "cpu" and mine.dtype == torch.float32 and mine.shape == theirs.shape


@pytest.mark.accelerator
@pytest.mark.parametrize("write", ["load_state_dict", "copy_", "optimizer step"])
def test_writes_to_a_streamed_scaled_weight_round_to_its_grid_and_the_ring_computes_with_them(
    write: str, accelerator: torch.device
) -> None:
    fmt = Scaled(torch.int8)
    model = blocks()
    reference = dequantised(model, fmt).to(accelerator)
    x = torch.randn(3, D, device=accelerator)
    offload(model, accelerator, storage_dtype=fmt, dtype=torch.float32, budget=least_budget(model, accelerator, storage_dtype=fmt))
    with torch.no_grad():
        model(x)  # the ring holds the groups' old values
    weight, plain = model[1][0].weight, reference[1][0].weight
    scale = own_scale(weight).clone()  # type: ignore[union-attr]
    new = torch.randn(weight.shape) * 0.03  # beyond the old range in places: saturates
    if write == "load_state_dict":
        model.load_state_dict({"1.0.weight": new}, strict=False)
        reference.load_state_dict({"1.0.weight": new}, strict=False)
    elif write == "copy_":
        with torch.no_grad():
            weight.copy_(new)
            plain.copy_(new)
    else:
        for m in (model, reference):
            optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
            m(x).square().sum().backward()  # through the groups' host values (no ring: autograd keeps them)
            optimizer.step()
        assert weight.grad is not None and weight.grad.device == accelerator
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            s = own_scale(p)
            if s is not None:  # the plain weight rounded to the grid of the scale it keeps
                q.copy_(dequantize(quantize_with(q, s.to(accelerator), fmt.dtype), s.to(accelerator), torch.float32))
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert torch.equal(own_scale(weight), scale)  # type: ignore[arg-type]
    assert weight.stored.dtype == torch.int8


@pytest.mark.accelerator
@pytest.mark.parametrize("fmt", FORMATS[::3], ids=IDS[::3])
def test_a_group_made_resident_after_the_first_forward_keeps_its_q_and_scale(
    fmt: Scaled, accelerator: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # which groups the measurements keep is timing; which one is kept is not what is tested here
    monkeypatch.setattr(measured_residency, "plan_residency", lambda costs, *args, **kwargs: [costs[0].name])
    model = blocks()
    reference = dequantised(model, fmt).to(accelerator)
    x = torch.randn(3, D, device=accelerator)
    handle = offload(model, accelerator, storage_dtype=fmt, dtype=torch.float32,
                     budget=least_budget(model, accelerator, storage_dtype=fmt))
    q = model[0][0].weight.stored.clone()
    with torch.no_grad():
        first = model(x)
        assert handle.stats().resident_groups == ["0"]
        weight = model[0][0].weight
        assert weight.stored.device == accelerator and own_scale(weight).device == accelerator  # type: ignore[union-attr]
        assert torch.equal(weight.stored.cpu().view(torch.uint8), q.view(torch.uint8))
        # resident, it is dequantised for each product, as it was widened into the ring slot
        torch.testing.assert_close(model(x), first, rtol=0, atol=0)
        torch.testing.assert_close(first, reference(x), rtol=0, atol=0)
    assert handle.stats().resident_bytes == kept_bytes(model[0].parameters())


# ---------------------------------------------------------------------- through the host ring on a CPU


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_streamed_on_a_cpu_a_scaled_weight_computes_as_one_kept_whole(fmt: Scaled) -> None:
    model = streamed_on_a_cpu()
    whole, reference = copy.deepcopy(model), dequantised(model, fmt)
    x = torch.randn(5, D)
    budget = least_budget(model, "cpu", storage_dtype=fmt, dtype=torch.float32)
    handle = offload(model, "cpu", storage_dtype=fmt, dtype=torch.float32, budget=budget)
    offload(whole, "cpu", storage_dtype=fmt, dtype=torch.float32, budget=1 << 30)  # resident: kept whole
    streamed = {p.name for p in handle.plan.params if p.residency is Residency.STREAMED}
    assert streamed == {f"{i}.{m}.weight" for i in range(4) for m in ("proj", "conv")}
    with torch.no_grad():
        expected = reference(x)
        for _ in range(3):
            got = model(x)
            torch.testing.assert_close(got, whole(x), rtol=0, atol=0)  # products scale the sums, as kept whole
            # the scale multiplies the sums instead of the weight: the same values, rounded once differently
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert handle.stats().bytes_moved == 3 * sum(kept_bytes(b.parameters()) - b.proj.bias.nbytes - b.conv.bias.nbytes for b in model)


def test_the_plan_counts_the_scales_and_the_widened_slot() -> None:
    fmt = Scaled(torch.float8_e4m3fn)
    model = streamed_on_a_cpu(2)
    handle = offload(model, "cpu", storage_dtype=fmt, dtype=torch.bfloat16, budget=least_budget(model, storage_dtype=fmt,
                                                                                                  dtype=torch.bfloat16))
    with torch.no_grad():
        model(torch.randn(2, D, dtype=torch.bfloat16))
    # the ring carries what each group keeps (its slot: the q values, then the scales, each aligned)
    for group, block in zip(handle.plan.groups, model, strict=True):
        ring = [p for p in group.params if p.residency is Residency.STREAMED]
        weights = [block.get_parameter(p.name.split(".", 1)[1]) for p in ring]
        assert sum(p.scale_nbytes for p in ring) == sum(own_scale(w).nbytes for w in weights)  # type: ignore[union-attr]
        assert group.nbytes == kept_bytes(block.parameters())
    assert handle.plan.groups[0].params[0].scale_nbytes == D * 4  # one fp32 scale per output channel


# ---------------------------------------------------------------------- compiled


@pytest.mark.parametrize("make", [blocks, streamed_on_a_cpu], ids=["kept whole", "streamed"])
@pytest.mark.parametrize("fmt", FORMATS[::3], ids=IDS[::3])
def test_a_compiled_forward_is_the_eager_forward_bit_for_bit(make: Callable[[], nn.Module], fmt: Scaled) -> None:
    # aot_eager runs the graph's operators as eager runs them: the products by scaled weights are one
    # operator (torchsurgery::scaled_product) that computes as eager does, so nothing may differ
    torch._dynamo.reset()
    model = make()
    budget = None if make is blocks else least_budget(model, storage_dtype=fmt, dtype=torch.float32)
    offload(model, "cpu", storage_dtype=fmt, dtype=torch.float32, budget=budget)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(3, D)
    try:
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
            expected = model(x)
            for _ in range(3):
                torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
    finally:
        torch._dynamo.reset()


@pytest.mark.accelerator
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_state_dict_of_a_streamed_scaled_model_is_made_on_the_host(fmt: Scaled, accelerator: torch.device) -> None:
    # it dequantised every weight on the device and kept them there (5.6x the budget); the
    # documentation promises host values, those of the plain model holding the dequantised values
    model = blocks()
    handle = offload(model, accelerator, storage_dtype=fmt, dtype=torch.float32, groups="leaves",
                     budget=least_budget(model, accelerator, storage_dtype=fmt, dtype=torch.float32, groups="leaves"))
    expected = {name: dequantize(stored_values(p), own_scale(p).cpu(), torch.float32) if own_scale(p) is not None
                else None for name, p in model.named_parameters()}
    torch.accelerator.synchronize()
    before = torch.accelerator.memory_allocated()
    state = model.state_dict()
    torch.accelerator.synchronize()
    assert torch.accelerator.memory_allocated() == before  # nothing of it on the device
    for name, want in expected.items():
        if want is not None:
            assert state[name].device.type == "cpu", name
            torch.testing.assert_close(state[name], want, rtol=0, atol=0)
    del state
    handle.remove()
