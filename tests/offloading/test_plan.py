"""Offload plans: decided before anything changes, printable, and what offload then installs."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import torchsurgery
from torchsurgery import Residency, offload
from torchsurgery.offloading import plan_offload, stored_values


class _Tied(nn.Module):
    """Two linear blocks and a head sharing the first block's weight."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.head = nn.Linear(d, d, bias=False)
        self.head.weight = self.blocks[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x).relu()
        return self.head(x)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.LayerNorm(8), nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)]), nn.Conv1d(1, 1, 3))


def _state(model: nn.Module) -> list[Any]:
    """Everything a plan must leave alone: identities, devices, dtypes, values, hooks, the undo log."""
    tensors = [(n, id(t), t.device, t.dtype, t.detach().clone()) for n, t in model.state_dict(keep_vars=True).items()]
    classes = [type(m) for m in model.modules()]
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    return [tensors, classes, hooks, torchsurgery.surgery_log(model)]


def _same_state(a: list[Any], b: list[Any], values: bool = True) -> bool:
    (ta, *rest_a), (tb, *rest_b) = a, b
    same_tensors = all(x[:4] == y[:4] and (not values or torch.equal(x[4], y[4])) for x, y in zip(ta, tb, strict=True))
    return same_tensors and rest_a == rest_b


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"storage_dtype": torch.bfloat16, "dtype": torch.float32},
        {"storage_dtype": torch.bfloat16, "master_dtype": torch.float32, "groups": "leaves"},
        {"budget": 10_000},
    ],
)
def test_planning_changes_nothing_and_offload_installs_that_plan(kwargs: dict[str, Any]) -> None:
    model = _mlp()
    before = _state(model)
    plan = plan_offload(model, **kwargs)
    assert _same_state(before, _state(model))
    handle = offload(model, **kwargs)
    assert str(handle.plan) == str(plan) and handle.plan.params == plan.params
    assert handle.stats().resident_groups == [g.name for g in plan.groups if g.resident]
    handle.remove()
    assert _same_state(before, _state(model), values="storage_dtype" not in kwargs)  # else rounded to bf16


@pytest.mark.accelerator
def test_each_residency_is_where_the_weights_then_are(accelerator: torch.device) -> None:
    model = _mlp()
    plan = plan_offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
    residency = {p.name: p.residency for p in plan.params}
    assert residency["1.0.weight"] is Residency.NARROW  # a CPU matmul layer reads its bf16 weight
    assert residency["0.weight"] is Residency.IN_PLACE  # a norm keeps its dtype: nothing moves on a CPU
    assert residency["2.weight"] is Residency.STREAMED  # a conv is widened through the ring
    with offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32):
        for p in plan.params:
            assert stored_values(p.lookup(model)).dtype == p.storage_dtype
            assert p.lookup(model).dtype == p.compute_dtype  # and reads as it computes
        assert model[1][0].weight.stored.untyped_storage().nbytes() == 64 * 2  # stored narrow: half the bytes
    on_device = plan_offload(model, accelerator, budget=10_000)
    assert {p.residency for p in on_device.params} == {Residency.RESIDENT}  # the model fits: kept whole
    assert all(p.storage_dtype == p.compute_dtype for p in on_device.params)
    with offload(model, accelerator, budget=10_000) as handle:
        assert handle.stats().resident_groups == [g.name for g in on_device.groups]


def test_master_copies_are_planned_as_shadows() -> None:
    model = _mlp()
    plan = plan_offload(model, storage_dtype=torch.bfloat16, master_dtype=torch.float32, dtype=torch.float32)
    linear = next(p for p in plan.params if p.name == "1.0.weight")
    assert (linear.storage_dtype, linear.shadow_dtype, linear.residency) == (torch.float32, torch.bfloat16, Residency.NARROW)
    assert all(p.shadow_dtype is None for p in plan.params if p.name.startswith("0."))  # the norm keeps its dtype


@pytest.mark.accelerator
def test_tied_weights_are_listed_under_each_name_and_counted_once(accelerator: torch.device) -> None:
    model = _Tied()
    reference = copy.deepcopy(model).to(accelerator)
    x = torch.randn(2, 8, device=accelerator)
    plan = plan_offload(model, accelerator, groups=["blocks.0", "blocks.1", "head"], budget=10**6 - 1, prefetch=0)
    tied = next(p for p in plan.params if p.name == "head.weight")
    assert tied.tied_to == "blocks.0.weight"
    head = next(g for g in plan.groups if g.name == "head")
    assert head.nbytes == 0  # its only weight is counted in blocks.0
    total = plan.device_bytes({g.name for g in plan.groups})  # the model whole, as the device counts it
    streamed = plan_offload(model, accelerator, groups=["blocks.0", "blocks.1", "head"], budget=total - 1, prefetch=0)
    by_name = {p.name: p.residency for p in streamed.params}
    assert by_name["blocks.0.weight"] is Residency.STREAMED
    assert by_name["head.weight"] is Residency.CONVERTED  # its host copy is blocks.0's buffer
    with torch.no_grad(), offload(model, accelerator, groups=["blocks.0", "blocks.1", "head"], budget=total - 1, prefetch=0):
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_checkpoint_keys_and_dtypes_come_from_the_file(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    model = _Tied()
    path = tmp_path / "tied.safetensors"
    state = {k: v.to(torch.float16) for k, v in model.state_dict().items() if k != "head.weight"}
    save_file(state, path)
    plan = plan_offload(model, storage=path)
    assert {p.residency for p in plan.params} == {Residency.FILE}
    keys = {p.name: p.file_key for p in plan.params}
    assert keys["head.weight"] == "blocks.0.weight"  # a tied weight is found under its other name
    assert all(p.storage_dtype == torch.float16 and p.compute_dtype == torch.float32 for p in plan.params)
    assert not any(p.is_meta for p in model.parameters())  # only the file's index was read


def test_the_table_shows_every_parameter() -> None:
    model = _Tied()
    text = str(plan_offload(model, storage_dtype=torch.float16, dtype=torch.float32))
    head, columns, *rows = text.splitlines()
    assert head.startswith("offload to cpu: 3 groups (0 resident)")
    assert columns.split() == ["group", "parameter", "residency", "storage", "compute", "shadow", "file", "key"]
    assert [r.split()[1] for r in rows] == ["blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias", "head.weight"]
    assert "(= blocks.0.weight)" in rows[-1]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"budget": 10}, ValueError, "cannot hold the largest group"),
        ({"groups": ["blocks.7"]}, ValueError, "did you mean"),
        ({"dtype": "fp16"}, TypeError, "dtype"),
        ({"prefetch": -1}, ValueError, "prefetch"),
        ({"storage": "missing.safetensors"}, (ValueError, FileNotFoundError), "missing"),
    ],
)
def test_bad_input_is_refused_by_the_plan(kwargs: dict[str, Any], error: Any, match: str) -> None:
    model = _Tied()
    before = _state(model)
    with pytest.raises(error, match=match):
        plan_offload(model, **kwargs)
    assert _same_state(before, _state(model))


def test_weights_without_values_need_a_checkpoint() -> None:
    with torchsurgery.skeleton():
        model = _Tied()
    with pytest.raises(ValueError, match="meta device"):
        plan_offload(model)


# ---------------------------------------------------------------------------
# storage and master dtypes: what weights can be stored in, checked before anything changes

STORABLE = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
NOT_STORABLE = [
    torch.float8_e8m0fnu,  # powers of two: no sign, no mantissa
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,  # no checkpoint or command-line name here
    torch.float4_e2m1fn_x2, torch.int8, torch.bool, torch.complex64, "bf16", float,
]


@pytest.mark.parametrize("call", [offload, plan_offload], ids=["offload", "plan_offload"])
@pytest.mark.parametrize("arg", ["storage_dtype", "master_dtype"])
@pytest.mark.parametrize("value", NOT_STORABLE, ids=str)
def test_a_dtype_weights_cannot_be_stored_in_is_a_type_error_naming_the_choices(call: Any, arg: str, value: Any) -> None:
    model = _mlp()
    before = _state(model)
    kwargs = {"storage_dtype": torch.bfloat16, "dtype": torch.float32, arg: value}
    with pytest.raises(TypeError) as refused:
        call(model, **kwargs)
    message = str(refused.value)
    assert message.startswith(f"torchsurgery.offload: {arg} must be a dtype weights can be stored in")
    assert message.endswith(f"got {value!r}") and all(str(d) in message for d in STORABLE)
    assert _same_state(before, _state(model))


@pytest.mark.parametrize("storage_dtype", STORABLE, ids=str)
def test_every_storable_dtype_is_a_storage_dtype_and_a_remove_gives_its_rounding(storage_dtype: torch.dtype) -> None:
    model = _mlp()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference[1].parameters():  # the linear layers and the conv are stored; the norm keeps fp32
            p.copy_(p.to(storage_dtype))
        for p in reference[2].parameters():
            p.copy_(p.to(storage_dtype))
    ids = [id(p) for p in model.parameters()]
    offload(model, storage_dtype=storage_dtype, dtype=torch.float32).remove()
    assert [id(p) for p in model.parameters()] == ids
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("weights", "storage", "master", "held"),
    [
        (torch.float32, torch.bfloat16, torch.float8_e4m3fn, False),  # would move weights by up to half a unit
        (torch.float32, torch.bfloat16, torch.bfloat16, False),  # would round them as storage does
        (torch.float32, torch.float8_e4m3fn, torch.float16, False),
        (torch.float32, torch.bfloat16, torch.float32, True),
        (torch.float32, torch.float8_e5m2, torch.float64, True),
        (torch.bfloat16, torch.float8_e4m3fn, torch.bfloat16, True),  # a bf16 model keeps a bf16 master
    ],
    ids=str,
)
def test_a_master_dtype_must_hold_the_weights_values_exactly(
    weights: torch.dtype, storage: torch.dtype, master: torch.dtype, held: bool
) -> None:
    model = _mlp().to(weights)
    before = _state(model)
    kwargs = {"storage_dtype": storage, "dtype": torch.float32, "master_dtype": master}
    if not held:
        for call in (plan_offload, offload):
            with pytest.raises(TypeError, match=(
                rf"torchsurgery\.offload: master_dtype must hold the values of the weights it keeps exactly, but "
                rf"{master} cannot hold those of '1\.0\.weight' \({weights}\); give one that can \(torch\.float64"
            )):
                call(model, **kwargs)
            assert _same_state(before, _state(model))
        return
    handle = offload(model, **kwargs)
    with torch.no_grad():
        model(torch.randn(2, 1, 8).to(torch.float32))
    handle.remove()
    assert _same_state(before, _state(model))  # the master gave every value back


def test_a_storage_dtype_with_a_checkpoint_keeps_the_file_s_weights_in_it(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    model = _Tied()
    path = tmp_path / "tied.safetensors"
    save_file({k: v for k, v in model.state_dict().items() if k != "head.weight"}, path)
    plan = plan_offload(model, storage=path, storage_dtype=torch.bfloat16, dtype=torch.float32)
    assert {(p.residency, p.storage_dtype) for p in plan.params} == {(Residency.FILE, torch.bfloat16)}
    expected = copy.deepcopy(model)
    offload(expected, storage_dtype=torch.bfloat16, dtype=torch.float32)
    before = _state(model)
    x = torch.linspace(-1, 1, 24).reshape(3, 8)
    with offload(model, storage=path, storage_dtype=torch.bfloat16, dtype=torch.float32, host_budget=0), torch.no_grad():
        assert torch.equal(model(x), expected(x))  # converted as read, computed as from memory
    assert _same_state(before, _state(model))  # read back from the file: the model's own values
