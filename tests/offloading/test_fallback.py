"""Never refuse what can run: without a budget of the user's, groups too large for the memory
there is fall back to finer ones, down to single weights, with one warning naming the choice.

The memory an offload may take without a ``budget`` is the device's (its free memory), or a
pool's room (``DevicePool`` without a budget of its own): when the model's blocks do not fit in
it streamed, single modules are streamed, then one at a time; only a single weight too large
for it is refused, naming the weight and the least memory that runs. A ``budget`` given is
the user's: below what the chosen groups need, it is refused as before. Each run is checked
against the plain model, bit for bit (the test device and the CPU compute with the CPU's kernels).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import tardy
import torchsurgery
from torchsurgery._device import AcceleratorDevice
from torchsurgery.errors import BudgetError
from torchsurgery.offloading.plan import sizes

_MIB = 1 << 20


def _model() -> nn.Sequential:
    """Four blocks of two convolutions (a group each, as "blocks" finds them): streamed through
    the ring, cast from bf16 at each run, on the CPU too."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Conv1d(32, 32, 3, padding=1), nn.Conv1d(32, 32, 3, padding=1)) for _ in range(4)])


_OPTIONS = {"dtype": torch.float32, "storage_dtype": torch.bfloat16, "skip": None}


def _need(model: nn.Module, device: torch.device, groups: str, prefetch: int) -> int:
    """Device bytes ``model`` needs streamed in ``groups`` at ``prefetch``, as the offload counts them."""
    return sizes(model, "test", **_OPTIONS, groups=groups, device=AcceleratorDevice(device), prefetch=prefetch)[2]


def _plain(model: nn.Module, device: torch.device, x: torch.Tensor) -> torch.Tensor:
    """The plain model's output with its weights rounded to bf16, as they are stored."""
    with torch.no_grad():
        plain = nn.Sequential(*[nn.Sequential(*[nn.Conv1d(32, 32, 3, padding=1) for _ in range(2)]) for _ in range(4)])
        plain.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
        return plain.to(device)(x.to(device)).cpu()


@contextlib.contextmanager
def _free(device: torch.device, budget: int) -> Iterator[None]:
    """The test device with as much free memory as makes an offload's default budget ``budget``
    (90% of what is free, less 256 MiB)."""
    free, total = torch.accelerator.get_memory_info(device)
    wanted = -(-(budget + 256 * _MIB) * 10 // 9)
    with tardy.settings(capacity=total - free + wanted):
        yield


def _run(model: nn.Module, device: torch.device, x: torch.Tensor, **options: object) -> tuple[torch.Tensor, list[str]]:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        handle = torchsurgery.offload(model, device, **_OPTIONS, **options)  # type: ignore[arg-type]
    with torch.no_grad():
        got = model(x.to(device)).cpu()
    handle.remove()
    return got, [str(w.message) for w in said if "torchsurgery" in str(w.message)]


@pytest.mark.accelerator
def test_without_a_budget_blocks_too_large_for_the_free_memory_stream_as_single_modules(accelerator: torch.device) -> None:
    if accelerator.type != tardy.NAME:
        pytest.skip("sets the free memory of the test device")
    model, x = _model(), torch.randn(2, 32, 16)
    blocks, modules = _need(model, accelerator, "blocks", 1), _need(model, accelerator, "leaves", 1)
    one = _need(model, accelerator, "leaves", 0)
    assert one < modules < blocks
    expected = _plain(model, accelerator, x)
    for budget, choice in (((modules + blocks) // 2, "single modules (groups='leaves')"),
                           ((one + modules) // 2, "single modules one at a time (groups='leaves', prefetch=0)")):
        with _free(accelerator, budget):
            got, said = _run(model, accelerator, x)
        assert torch.equal(got, expected)
        assert len(said) == 1 and said[0].startswith("torchsurgery.offload: its groups need "), said
        assert said[0].endswith(f"streaming {choice} instead")
    assert torchsurgery.surgery_log(model) == []


@pytest.mark.accelerator
def test_without_a_budget_only_a_single_weight_too_large_is_refused_naming_it(accelerator: torch.device) -> None:
    if accelerator.type != tardy.NAME:
        pytest.skip("sets the free memory of the test device")
    model = _model()
    one = _need(model, accelerator, "leaves", 0)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with _free(accelerator, one - 1024), pytest.raises(BudgetError) as refused:
        torchsurgery.offload(model, accelerator, **_OPTIONS)  # type: ignore[arg-type]
    assert refused.value.needed == one and refused.value.group == "0.0"
    assert "largest single weight '0.0.weight'" in str(refused.value) and f"({one} bytes)" in str(refused.value)
    assert torchsurgery.surgery_log(model) == [] and all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("where", ["cpu", "accelerator"])
def test_an_explicit_budget_below_the_blocks_is_still_refused(where: str, request: pytest.FixtureRequest) -> None:
    device = torch.device("cpu") if where == "cpu" else request.getfixturevalue("accelerator")
    model = _model()
    blocks, modules = _need(model, device, "blocks", 1), _need(model, device, "leaves", 1)
    with pytest.raises(BudgetError) as refused:
        torchsurgery.offload(model, device, budget=(modules + blocks) // 2, **_OPTIONS)  # type: ignore[arg-type]
    assert refused.value.needed == blocks and "groups='leaves'" in str(refused.value)
    pool = torchsurgery.DevicePool(device, budget=(modules + blocks) // 2)
    with pytest.raises(ValueError, match="is below what 'Sequential' needs on the device"):
        pool.add(model, **_OPTIONS)  # type: ignore[arg-type]
    assert torchsurgery.surgery_log(model) == []


def test_a_pool_without_a_budget_streams_single_modules_where_its_room_is_too_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU: a pool that keeps memory free has the host's available memory less that as its
    room (set here), not a budget of the user's."""
    cpu = torch.device("cpu")
    model, x = _model(), torch.randn(2, 32, 16)
    expected = _plain(model, cpu, x)
    blocks, modules = _need(model, cpu, "blocks", 1), _need(model, cpu, "leaves", 1)
    monkeypatch.setattr(AcceleratorDevice, "available_bytes", lambda self: 10 * _MIB + (modules + blocks) // 2)
    pool = torchsurgery.DevicePool(cpu, keep_free=10 * _MIB)
    pool.add(model, name="convs", **_OPTIONS)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        handle = pool.load(model)
    messages = [str(w.message) for w in said]
    assert messages == [f"torchsurgery.DevicePool.load: 'convs': {messages[0].split(': ', 2)[2]}"]
    assert messages[0].endswith("streaming single modules (groups='leaves') instead")
    assert [g.name for g in handle.plan.groups] == [f"{b}.{c}" for b in range(4) for c in range(2)]
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    heard: list[tuple[nn.Module, str]] = []
    pool.close()
    told = torchsurgery.DevicePool(cpu, keep_free=10 * _MIB, on_fallback=lambda m, s: heard.append((m, s)))
    told.add(model, name="convs", **_OPTIONS)  # type: ignore[arg-type]
    told.load(model)
    assert len(heard) == 1 and heard[0][0] is model and heard[0][1] == messages[0].split(": ", 2)[2]
    told.close()
    assert torchsurgery.surgery_log(model) == []


@pytest.mark.accelerator
def test_a_conversion_within_an_explicit_budget_that_holds_the_converted_model_is_taken(accelerator: torch.device) -> None:
    """A bf16 model streamed within the least budget of its converted self: converting its head to
    fp32 (as FramePack's transformer does inside its forward) is checked as the converted model is
    planned, its head then kept in fp32 (no cast at each run), not refused for a cast it will not make."""
    import copy

    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Conv1d(32, 32, 3, padding=1), nn.Conv1d(32, 32, 3, padding=1)) for _ in range(4)])
    model = nn.Sequential(blocks, nn.Conv1d(32, 8, 1)).to(torch.bfloat16)
    plain = copy.deepcopy(model).to(accelerator)
    plain[1].to(torch.float32)
    options = {"dtype": None, "storage_dtype": None, "skip": None, "groups": "blocks"}
    budget = sizes(copy.deepcopy(plain).cpu(), "test", **options, device=AcceleratorDevice(accelerator))[2]  # type: ignore[arg-type]
    x = torch.randn(2, 32, 16, dtype=torch.bfloat16, device=accelerator)
    with torch.no_grad():
        expected = plain[1](plain[0](x).float())
    handle = torchsurgery.offload(model, accelerator, budget=budget)
    model[1].to(torch.float32)
    assert handle.plan.budget == budget and all(not g.resident for g in handle.plan.groups)
    with torch.no_grad():
        assert torch.equal(model[1](model[0](x).float()), expected)
    handle.remove()
    assert model[1].weight.dtype == torch.float32 and model[0][0][0].weight.dtype == torch.bfloat16
