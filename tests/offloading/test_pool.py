"""Tests of DevicePool: several models on one device, least recently used pushed back."""

from __future__ import annotations

import copy
import gc
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _offload_models import least_budget
from torch import nn

import torchsurgery
from torchsurgery import DevicePool
from torchsurgery._device import AcceleratorDevice
from torchsurgery.compact import Scaled, stored_values


def blocks(n: int = 4, d: int = 16) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(n)]).eval()


BLOCK = (16 * 16 + 16) * 4  # one block's bytes in fp32
WHOLE = 4 * BLOCK
WHOLE64 = 2 * WHOLE + 16 * 16 * 4  # stored in fp64 (lossless), and one weight widened to fp32 for a product


def identity_map(model: nn.Module) -> dict[str, tuple[int, torch.device, torch.dtype]]:
    return {n: (id(t), t.device, t.dtype) for n, t in model.state_dict(keep_vars=True).items()}


def fingerprint(pool: DevicePool) -> dict[str, Any]:
    return {name: (s.state, s.loads, s.pushed_back) for name, s in pool.stats().items()}


X = torch.randn(3, 16)


def test_models_fit_whole_until_the_budget_pushes_the_least_recently_used_back() -> None:
    pool = DevicePool("cpu", budget=2 * WHOLE)
    a, b, c = (pool.add(blocks(), name=n) for n in "abc")
    pool.load(a)
    pool.load(b)
    assert (pool.state(a), pool.state(b), pool.state(c)) == ("whole", "whole", "host")
    a(X)  # a forward is a use: b is now the least recently used
    pool.load(c)
    assert (pool.state(a), pool.state(b), pool.state(c)) == ("whole", "host", "whole")
    stats = pool.stats()
    assert stats["b"].pushed_back == 1 and stats["a"].pushed_back == 0
    assert stats["c"].device_bytes == WHOLE and stats["b"].device_bytes == 0
    assert stats["a"].offload is not None and stats["b"].offload is None
    pool.close()


def test_a_model_larger_than_the_room_is_loaded_partly_with_the_same_outputs() -> None:
    model = blocks().requires_grad_(False)
    expected = model(X)
    ids = identity_map(model)
    pool = DevicePool("cpu", budget=6 * BLOCK)  # whole needs WHOLE64: 8 blocks' bytes and more
    pool.add(model, storage_dtype=torch.float64, dtype=torch.float32)
    handle = pool.load(model)
    assert pool.state(model) == "partial" and handle.stats().streamed_groups
    torch.testing.assert_close(model(X), expected)
    pool.discard(model)
    assert identity_map(model) == ids and torchsurgery.surgery_log(model) == []
    torch.testing.assert_close(model(X), expected)


@pytest.mark.parametrize("where", ["cpu", pytest.param("accelerator", marks=pytest.mark.accelerator)])
def test_a_model_loaded_with_a_storage_dtype_computes_as_offloaded_whole_or_partly(
    where: str, request: pytest.FixtureRequest
) -> None:
    device = torch.device("cpu") if where == "cpu" else request.getfixturevalue("accelerator")
    n = 8  # blocks: enough that streaming (the ring's slots, rounded as the device allocates) holds less than the whole
    model = blocks(n)
    reference = copy.deepcopy(model)
    x = X.to(device)
    kwargs: dict[str, Any] = {"storage_dtype": torch.bfloat16, "dtype": torch.float32}
    with torch.no_grad():
        handle = torchsurgery.offload(reference, device, **kwargs)
        expected = reference(x)
        held = sum(stored_values(p).nbytes for p in reference.parameters())
        handle.remove()  # the weights keep their bf16 rounding
    whole = n * BLOCK // 2 + 16 * 16 * 4  # in bf16, and one weight widened to fp32 for a product
    streaming = max(least_budget(model, device, **kwargs), 2 * BLOCK)
    if device.type != "cpu":  # as the device's allocator counts it (each allocation rounded up)
        plan = torchsurgery.plan_offload(copy.deepcopy(model), device, **kwargs)
        whole = plan.device_bytes({g.name for g in plan.groups})
    assert streaming < whole
    for budget, state in ((4 * whole, "whole"), (streaming, "partial")):
        pool = DevicePool(device, budget=budget)
        pool.add(model, name="m", **kwargs)
        handle = pool.load(model)
        stats = pool.stats()["m"]
        assert (stats.state, stats.total_bytes, stats.largest_group_bytes) == (state, whole, BLOCK // 2)
        with torch.no_grad():
            for _ in range(2):  # the second after what the first forward measured
                torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
        assert sum(stored_values(p).nbytes for p in model.parameters()) == held  # bf16, resident or not
        assert handle.stats().resident_bytes <= pool.stats()["m"].device_bytes
        pool.close()
        for name, value in reference.state_dict().items():  # pushed back as offload's remove() leaves it
            torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("where", ["cpu", pytest.param("accelerator", marks=pytest.mark.accelerator)])
def test_a_model_pooled_in_a_scaled_format_loads_and_goes_back_with_the_dequantised_values(
    where: str, request: pytest.FixtureRequest
) -> None:
    device = torch.device("cpu") if where == "cpu" else request.getfixturevalue("accelerator")
    # bit for bit where the CPU's kernels run; on a GPU a slot and a kept weight may take two cuBLAS algorithms
    tol = request.getfixturevalue("exact_on_tardy") if where != "cpu" else {"rtol": 0.0, "atol": 0.0}
    kwargs: dict[str, Any] = {"storage_dtype": Scaled(torch.float8_e4m3fn), "dtype": torch.float32}
    model = blocks(8)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)  # a typical scale: unscaled fp8 would be subnormal
    reference = copy.deepcopy(model)
    x = X.to(device)
    with torch.no_grad():
        handle = torchsurgery.offload(reference, device, **kwargs)  # kept whole
        expected = reference(x)
        handle.remove()  # the dequantised values, in fp32
    plan = torchsurgery.plan_offload(copy.deepcopy(model), device, **kwargs)
    whole, streaming = plan.device_bytes({g.name for g in plan.groups}), least_budget(model, device, **kwargs)
    assert streaming < whole
    ids = identity_map(model)
    pool = DevicePool(device, budget=whole)
    pool.add(model, name="m", **kwargs)
    for budget, state, put_back in ((whole, "whole", "unload"), (whole, "whole", "shrink"), (streaming, "partial", "close")):
        pool.budget = budget
        pool.load(model)  # from the second load on, the values the previous one gave back: quantised to the same
        assert pool.stats()["m"].state == state and pool.stats()["m"].total_bytes == whole  # the scales counted
        with torch.no_grad():
            for _ in range(2):  # the second after what the first forward measured
                torch.testing.assert_close(model(x), expected, **tol)
        if put_back == "unload":
            pool.unload(model)
        elif put_back == "shrink":
            assert pool.shrink(model, keep_free=1 << 62) is None
        else:
            pool.close()
        assert identity_map(model) == ids
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)


def test_loading_again_only_marks_a_use_and_plans_again_when_room_appeared() -> None:
    pool = DevicePool("cpu", budget=WHOLE64 + BLOCK)
    a = pool.add(blocks(), name="a", storage_dtype=torch.float64, dtype=torch.float32)
    b = pool.add(blocks(), name="b", storage_dtype=torch.float64, dtype=torch.float32)
    pool.load(a)
    first = pool.load(b)  # a goes back, b fits whole
    assert pool.load(b) is first and pool.stats()["b"].loads == 1
    pool.load(a)  # b goes back
    assert (pool.state(a), pool.state(b)) == ("whole", "host")
    pool.close()


def test_the_pool_is_in_the_undo_log_and_restore_takes_a_model_out() -> None:
    model = blocks()
    ids = identity_map(model)
    options: dict[str, Any] = {"storage_dtype": torch.float64, "dtype": torch.float32}
    pool = DevicePool("cpu", budget=2 * WHOLE)  # less than the model whole in fp64: streamed
    pool.add(model, name="m", **options)
    pool.load(model)
    assert pool.state(model) == "partial"
    assert [e.kind for e in torchsurgery.surgery_log(model)] == ["pool", "offload"]
    torchsurgery.restore(model)
    assert model not in pool and pool.models == []
    assert identity_map(model) == ids and torchsurgery.surgery_log(model) == []
    assert not model._forward_pre_hooks


def test_an_offload_undone_from_outside_leaves_the_model_on_the_host() -> None:
    pool = DevicePool("cpu", budget=WHOLE64)
    model = pool.add(blocks(), storage_dtype=torch.float64, dtype=torch.float32)
    handle = pool.load(model)
    handle.remove()
    assert pool.state(model) == "host"
    pool.load(model)
    assert pool.state(model) == "whole"
    pool.close()


# ---------------------------------------------------------------------------
# bad input: a clear error, and nothing changes


def test_a_model_in_two_pools_is_refused() -> None:
    first, second = DevicePool("cpu"), DevicePool("cpu")
    model = first.add(blocks(), name="m")
    with pytest.raises(ValueError, match="already in the pool of cpu as 'm'; a model belongs to one pool"):
        second.add(model)
    with pytest.raises(ValueError, match="already in this pool"):
        first.add(model)
    assert second.models == [] and [e.kind for e in torchsurgery.surgery_log(model)] == ["pool"]
    first.close()


def test_a_budget_below_what_a_model_needs_is_refused_naming_the_sizes() -> None:
    # on a CPU, fp32 weights stream in place (no ring slots): the least is one block resident
    pool = DevicePool("cpu", budget=BLOCK - 1)
    model = blocks()
    with pytest.raises(ValueError, match=rf"{WHOLE} bytes whole, or {BLOCK} bytes streamed"):
        pool.add(model)
    assert pool.models == [] and torchsurgery.surgery_log(model) == [] and not model._forward_pre_hooks


@pytest.mark.parametrize("where", ["cpu", pytest.param("accelerator", marks=pytest.mark.accelerator)])
@pytest.mark.parametrize("storage_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_pool_counts_the_least_a_model_needs_as_its_offload_does(
    where: str, storage_dtype: torch.dtype | None, request: pytest.FixtureRequest
) -> None:
    # a parameter subclass and tied weights: not packed into the ring, converted at each run instead
    device = torch.device("cpu") if where == "cpu" else request.getfixturevalue("accelerator")
    model = blocks()
    model[0][0].bias = _Tagged(model[0][0].bias.detach().clone())
    model[3][0].weight = model[1][0].weight
    options: dict[str, Any] = {"storage_dtype": storage_dtype, "dtype": torch.float32, "groups": "leaves"}
    least = least_budget(model, device, **options)
    pool = DevicePool(device, budget=least)
    pool.add(model, **options)  # accepted at the least budget the offload accepts
    handle = pool.load(model)
    assert handle.plan.budget == least
    pool.close()
    with pytest.raises(ValueError, match=rf"or {least} bytes streamed"):
        DevicePool(device, budget=least - 1).add(model, **options)


class _Tagged(nn.Parameter):
    """A parameter subclass of the model's own."""


@pytest.mark.parametrize("value", [torch.float8_e8m0fnu, torch.float8_e4m3fnuz, torch.int8, "bf16"], ids=str)
def test_a_storage_dtype_offload_refuses_is_refused_when_added(value: Any) -> None:
    pool = DevicePool("cpu")
    model = blocks()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = identity_map(model)
    with pytest.raises(TypeError, match=rf"torchsurgery\.DevicePool\.add: storage_dtype must be a dtype weights can "
                                        rf"be stored in .*torch\.bfloat16.*, got {value!r}"):
        pool.add(model, storage_dtype=value)
    assert pool.models == [] and torchsurgery.surgery_log(model) == [] and not model._forward_pre_hooks
    assert identity_map(model) == ids and [type(m) for m in model.modules()] == [type(m) for m in blocks().modules()]
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


def test_unknown_models_are_refused_naming_the_pool_s_models() -> None:
    pool = DevicePool("cpu")
    _known = pool.add(blocks(), name="known")  # kept alive: a pool holds its models weakly
    for call in (pool.load, pool.unload, pool.discard, pool.state):
        with pytest.raises(ValueError, match=r"not in the pool \(it holds \['known'\]\); add\(\) it first"):
            call(blocks())
    pool.close()


def test_no_room_even_with_every_other_model_pushed_back_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = DevicePool("cpu", keep_free=1000)
    a = pool.add(blocks(), name="a")
    monkeypatch.setattr(AcceleratorDevice, "available_bytes", lambda self: 1000 + 10 * WHOLE)
    pool.load(a)
    b = pool.add(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), name="b")  # a group is larger than a
    before = fingerprint(pool), identity_map(a), identity_map(b)
    monkeypatch.setattr(AcceleratorDevice, "available_bytes", lambda self: 1000)  # a's WHOLE bytes are all there is
    with pytest.raises(RuntimeError, match="'b' needs .* but only .* bytes can be made free"):
        pool.load(b)
    assert (fingerprint(pool), identity_map(a), identity_map(b)) == before
    pool.close()


def test_a_pool_whose_device_vanished_refuses_work_and_still_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = DevicePool("cpu")
    model = pool.add(blocks())
    pool.load(model)
    before = fingerprint(pool), identity_map(model)
    monkeypatch.setattr(AcceleratorDevice, "missing", lambda self: "CUDA is not available")
    with pytest.raises(RuntimeError, match="device cpu is gone .*call close\\(\\)"):
        pool.load(model)
    with pytest.raises(RuntimeError, match="is gone"):
        pool.add(blocks())
    assert identity_map(model) == before[1]
    pool.close()
    assert pool.models == [] and torchsurgery.surgery_log(model) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"device": "meta"}, ValueError, "device 'meta' holds no values"),
        ({"device": "nonsense"}, ValueError, "is not a device"),
        ({"budget": -1}, ValueError, "budget must be a number of bytes"),
        ({"keep_free": 1.5}, TypeError, "keep_free must be a number of bytes"),
        ({"budget": 10, "keep_free": 10}, ValueError, "not both"),
    ],
)
def test_bad_pool_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        DevicePool(**{"device": "cpu", **kwargs})


def test_a_pool_on_an_accelerator_pytorch_does_not_report_is_refused() -> None:
    reported = torch.accelerator.current_accelerator()
    other = "xpu" if reported is not None and reported.type == "cuda" else "cuda"
    with pytest.raises(ValueError, match=f"'{other}' is not available: this PyTorch reports"):
        DevicePool(other)


def test_a_taken_name_is_refused() -> None:
    pool = DevicePool("cpu")
    m = pool.add(blocks(), name="m")
    with pytest.raises(ValueError, match="name 'm' is taken"):
        pool.add(blocks(), name="m")
    other = pool.add(blocks())
    assert [s for s in pool.stats()] == ["m", "Sequential"]
    pool.close()
    assert torchsurgery.surgery_log(m) == torchsurgery.surgery_log(other) == []


@pytest.mark.accelerator
def test_on_the_accelerator_models_move_within_the_budget_and_go_back_exactly(
    accelerator: torch.device, allocation_bytes: Callable[[int], int]
) -> None:
    a, b = blocks(2).requires_grad_(False), blocks(4).requires_grad_(False)
    resident = [copy.deepcopy(m).to(accelerator) for m in (a, b)]
    x = X.to(accelerator)
    expected = [m(x) for m in resident]
    ids = [identity_map(m) for m in (a, b)]
    del resident
    torch.accelerator.synchronize()
    torch.accelerator.reset_peak_memory_stats()
    before = torch.accelerator.memory_allocated()
    budget = least_budget(b, accelerator)  # b streams in it; a fits whole, b does not
    assert 2 * BLOCK < budget < 4 * BLOCK
    pool = DevicePool(accelerator, budget=budget)
    pool.add(a, name="a")
    pool.add(b, name="b")
    pool.load(a)
    assert all(p.device == accelerator for p in a.parameters())  # whole: the weights themselves moved
    torch.testing.assert_close(a(x), expected[0], rtol=0, atol=0)
    pool.load(b)  # does not fit next to a, nor whole: a goes back to the host, b streams partly
    assert (pool.state(a), pool.state(b)) == ("host", "partial")
    assert all(p.device.type == "cpu" for p in a.parameters())
    torch.testing.assert_close(b(x), expected[1], rtol=0, atol=0)
    assert pool.stats()["b"].offload.bytes_moved > 0
    torch.accelerator.synchronize()
    # within the budget, besides the activations, as the device's allocator counts them
    assert torch.accelerator.max_memory_allocated() - before <= budget + 4 * allocation_bytes(x.nbytes)
    pool.close()
    assert [identity_map(m) for m in (a, b)] == ids


class _Widened(torchsurgery.Patch, nn.Linear):
    """Adds a parameter as large as the layer's weight (surgery on the host that grows the model)."""

    def __patch_init__(self) -> None:
        self.extra = nn.Parameter(torch.zeros_like(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight + self.extra, self.bias)


@pytest.mark.accelerator
def test_a_model_patched_on_the_host_is_sized_again_when_loaded(accelerator: torch.device) -> None:
    model = blocks()
    options: dict[str, Any] = {"dtype": torch.float32, "groups": "leaves"}
    plan = torchsurgery.plan_offload(model, accelerator, **options)
    pool = DevicePool(accelerator, budget=plan.device_bytes([g.name for g in plan.groups]))  # whole, as added
    pool.add(model, **options)
    torchsurgery.patch(model[0][0], _Widened)  # larger now: no longer fits whole
    reference = copy.deepcopy(model).to(accelerator)
    x = torch.randn(2, 16, device=accelerator)
    pool.load(model)
    assert pool.state(model) == "partial"  # planned for what it is now, not for what was added
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


@pytest.mark.accelerator
def test_on_the_accelerator_a_model_pushed_back_frees_what_it_held_not_what_it_was_granted(accelerator: torch.device) -> None:
    """Planned again for more memory to keep free, a loaded model is counted by what its push-back
    frees (measured), not by its grant: before its first forward it holds the ring only."""
    gc.collect()  # device memory earlier tests left in reference cycles goes now, not half-way through
    model = blocks(8)
    ids = identity_map(model)
    pool = DevicePool(accelerator)  # the device's free memory is the limit
    # one module at a time: the finest plan, below which a pool without a budget refuses (above
    # it, it would stream finer groups instead)
    pool.add(model, name="m", prefetch=0)
    least = least_budget(model, accelerator, prefetch=0)  # the ring's slot: what it needs streamed
    free = pool.free_bytes()
    pool.load(model, keep_free=free - (least + 4 * BLOCK))  # granted the ring and four blocks
    assert pool.state(model) == "partial"
    # counted with its grant, the ring and three blocks would seem free beyond this; pushed back,
    # it frees its ring alone, a block short of what it needs streamed
    with pytest.raises(RuntimeError, match=r"'m' needs .* with the other models pushed back only \d+ bytes are free"):
        pool.load(model, keep_free=free - least + BLOCK)
    assert pool.state(model) == "host" and identity_map(model) == ids
    assert pool.free_bytes() >= free  # it holds nothing on the device
    pool.close()


@pytest.mark.accelerator
def test_unload_all_pushes_every_model_back_and_frees_what_they_held(accelerator: torch.device) -> None:
    # FramePack's unload_complete_models: whole and partly loaded models alike go back to the
    # host, as they were, and the device holds nothing of them; loaded again they compute as before
    gc.collect()
    models = [blocks(2).requires_grad_(False), blocks(8).requires_grad_(False)]
    x = X.to(accelerator)
    expected = [copy.deepcopy(m).to(accelerator)(x) for m in models]
    ids = [identity_map(m) for m in models]
    torch.accelerator.synchronize()
    before = torch.accelerator.memory_allocated()
    pool = DevicePool(accelerator, budget=least_budget(models[1], accelerator) + 2 * BLOCK)
    for name, model in zip("ab", models, strict=True):
        pool.add(model, name=name)
    pool.load(models[0])
    pool.load(models[1])  # a keeps its place only if there is room: one of them at least is on the device
    states = {pool.state(m) for m in models}
    assert states - {"host"}
    pool.unload_all()
    assert [pool.state(m) for m in models] == ["host", "host"]
    assert [identity_map(m) for m in models] == ids
    torch.accelerator.synchronize()
    assert torch.accelerator.memory_allocated() == before
    for model, out in zip(models, expected, strict=True):
        pool.load(model)
        torch.testing.assert_close(model(x), out, rtol=0, atol=0)
    pool.close()
    assert [identity_map(m) for m in models] == ids


def test_a_pool_hook_pickled_under_its_old_name_still_loads() -> None:
    # what a model pickled while in a pool holds: its detached forward hook, by the name it had
    payload = b"\x80\x02ctorchsurgery.offloading.pool\n_Touch\nNN\x86R."
    hook = pickle.loads(payload)
    assert hook(nn.Linear(2, 2), ()) is None and hook.members is None


@pytest.mark.parametrize("streamed", [False, True], ids=["from-memory", "from-a-checkpoint"])
def test_a_model_a_pool_without_budgets_loaded_pickles_and_deep_copies(tmp_path: Path, streamed: bool) -> None:
    # a pool without a budget or a host budget gives its members fallbacks that tell it (weakly) of
    # finer groups: a copy of a loaded model is in no pool, and copies as any offloaded model does
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    path = tmp_path / "model.safetensors"
    save_file(model.state_dict(), path)
    pool = torchsurgery.DevicePool("cpu")
    pool.add(model, groups="leaves", storage=path if streamed else None)
    pool.load(model)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(_saved_to_bytes(model), weights_only=False)):
        with torch.no_grad():
            assert torch.equal(copied(x), expected)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    pool.close()


def _saved_to_bytes(model: nn.Module) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return buffer
