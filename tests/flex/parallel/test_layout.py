"""Layouts over 4 gloo ranks: Megatron order, a 2x2 (dp, tp) device mesh on a hand-made
tensor-parallel MLP, 4 pipeline stages, and 2 stages x 2 data-parallel replicas."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _captures import assert_captured
from _models import MLP, Stack, stage_of, tensor_parallel_mlp
from _spawn import spawn
from torch import nn

from torchsurgery import FlexModel, HookFunction
from torchsurgery.flex.parallel import make_layout

pytestmark = pytest.mark.distributed
ROWS = [3, 2]  # unequal data-parallel batches


def _mlp_case() -> tuple[MLP, torch.Tensor, nn.Linear]:
    torch.manual_seed(0)
    return MLP(8, 16), torch.randn(sum(ROWS), 4, 8), nn.Linear(16, 16)


def _center(module: nn.Module, x: torch.Tensor, ctx: Any, modules: nn.ModuleDict) -> torch.Tensor:
    return x - x.mean(0, keepdim=True) + 0.1 * modules["probe"](x)


def _register_mlp(flex: FlexModel, probe: nn.Linear) -> None:
    flex.register_trainable_module("probe", probe)
    flex.register_forward_hook(HookFunction("fc1", (None, None, 16), _center))
    flex.register_forward_hook(HookFunction("fc2"))


def _stack_case() -> tuple[Stack, torch.Tensor]:
    torch.manual_seed(0)
    return Stack(4, 8), torch.randn(sum(ROWS), 8)


def _register_stack(flex: FlexModel) -> None:
    flex.register_forward_hook(HookFunction("layers.*.fc1", (None, 16)))  # column-parallel: sharded
    flex.register_forward_hook(HookFunction("layers.2.fc1", (None, 16), lambda m, x, c, mods: 2 * x))
    flex.register_full_backward_pre_hook(HookFunction("layers.*"))


def _four_rank_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    result: dict[str, Any] = {}
    layout = make_layout(tensor_parallel_size=2, data_parallel_size=2)
    result["coords"] = (layout.pp_rank, layout.dp_rank, layout.tp_rank)
    result["tp_ranks"] = dist.get_process_group_ranks(layout.tp_group)
    result["dp_ranks"] = dist.get_process_group_ranks(layout.dp_group)

    # (dp, tp) = 2 x 2 from a device mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    reference, x, probe = _mlp_case()
    model = tensor_parallel_mlp(reference, tp, 2, mesh.get_group("tp"))
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out, device_mesh=mesh)
    _register_mlp(flex, probe)
    y = flex(x.split(ROWS)[dp])
    (y**2).sum().backward()
    result["mlp"] = {
        "dp": dp, "tp": tp, "y": y.detach(), "out": out, "probe_grad": probe.weight.grad,
        "fc1_grad": model.fc1.weight.grad, "sizes": (flex.tp_size, flex.dp_size, flex.pp_size),
    }

    # 4 pipeline stages; stages 0 and 2 capture nothing
    stack, xs = _stack_case()
    out = {}
    flex = FlexModel(stage_of(copy.deepcopy(stack), rank, 4), out, pipeline_parallel_size=4)
    flex.register_forward_hook(HookFunction("layers.1"))
    flex.register_forward_hook(HookFunction("layers.3"))
    result["pp4"] = {"y": flex(xs), "out": out}

    # 2 stages x 2 data-parallel replicas (Megatron order: ranks 0,1 are stage 0)
    pp, dpr = rank // 2, rank % 2
    out = {}
    flex = FlexModel(stage_of(copy.deepcopy(stack), pp, 2), out, pipeline_parallel_size=2, data_parallel_size=2)
    flex.register_forward_hook(HookFunction("layers.*"))
    result["pp2dp2"] = {"y": flex(xs.split(ROWS)[dpr]), "out": out}

    # 2 stages x 2 tensor-parallel ranks from a (pp, tp) mesh, forward and backward, captures on rank 0
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    stage = stage_of(copy.deepcopy(stack), pp, 2)
    for name, layer in list(stage.layers.items()):
        stage.layers[name] = tensor_parallel_mlp(layer, tp, 2, mesh.get_group("tp"))
    out = {}
    flex = FlexModel(stage, out, device_mesh=mesh, captures_on="first_rank")
    _register_stack(flex)
    y = flex(xs)
    flex.backward((y**2).sum() if y is not None else None)
    result["pp2tp2"] = {
        "pp": pp, "tp": tp, "y": y, "out": out,
        "grads": {n: p.grad for n, p in stage.named_parameters()},
    }

    # restricted to ranks 2 and 3: they hold output_ptr, ranks 0 and 1 take no part
    group = dist.new_group([2, 3], use_local_synchronization=True) if rank >= 2 else None
    if group is not None:
        out = {}
        flex = FlexModel(copy.deepcopy(stack), out, data_parallel_size=2, process_group=group)
        flex.register_forward_hook(HookFunction("layers.*"))
        result["group"] = {"y": flex(xs.split(ROWS)[rank - 2]), "out": out}
    return result


def test_four_ranks_match_one_process() -> None:
    results = spawn(_four_rank_worker, 4)

    # Megatron order: tensor-parallel ranks contiguous, data-parallel next
    assert [r["coords"] for r in results] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert [r["tp_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]

    # 2 x 2 (dp, tp)
    reference, x, probe = _mlp_case()
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(reference, out)
    _register_mlp(flex, probe)
    y = flex(x)
    (y**2).sum().backward()
    mlp = [r["mlp"] for r in results]
    assert all(m["sizes"] == (2, 2, 1) for m in mlp)
    for m in mlp:
        torch.testing.assert_close(m["y"], y.split(ROWS)[m["dp"]])
        # averaged over the 2 replicas, as DDP averages: the gradient of the mean of their losses
        torch.testing.assert_close(m["probe_grad"] * 2, probe.weight.grad)
    for m in mlp:  # every rank holds every replica's rows, unsharded
        assert_captured(m["out"], out)
    # each replica's shard gradient covers its rows: summed over replicas, one process's shard
    for tp in range(2):
        shard = sum(m["fc1_grad"] for m in mlp if m["tp"] == tp)
        torch.testing.assert_close(shard, reference.fc1.weight.grad.chunk(2, 0)[tp])

    stack, xs = _stack_case()
    out = {}
    flex = FlexModel(stack, out)
    flex.register_forward_hook(HookFunction("layers.*"))
    ys = flex(xs)

    pp4 = [r["pp4"] for r in results]
    assert [p["y"] is None for p in pp4] == [True, True, True, False]
    torch.testing.assert_close(pp4[3]["y"], ys)
    for p in pp4:  # every stage holds every stage's captures
        assert_captured(p["out"], {key: out[key] for key in ("layers.1", "layers.3")})

    both = [r["pp2dp2"] for r in results]
    torch.testing.assert_close(both[2]["y"], ys.split(ROWS)[0])
    torch.testing.assert_close(both[3]["y"], ys.split(ROWS)[1])
    for b in both:
        assert_captured(b["out"], out)

    # (pp, tp) = 2 x 2
    edited, xs = _stack_case()
    edited_out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(edited, edited_out)
    _register_stack(flex)
    edited_ys = flex(xs)
    flex.backward((edited_ys**2).sum())
    staged = [r["pp2tp2"] for r in results]
    for b in staged:
        assert (b["y"] is None) == (b["pp"] == 0)
        if b["y"] is not None:
            torch.testing.assert_close(b["y"], edited_ys)
    assert sorted(staged[0]["out"]) == sorted(edited_out) and len(edited_out) == 9
    for key, values in edited_out.items():
        torch.testing.assert_close(staged[0]["out"][key][0], values[0], msg=key)
    assert all(b["out"] == {} for b in staged[1:])  # captures_on="first_rank"
    for name, p in edited.named_parameters():
        holders = [b for b in staged if name in b["grads"]]
        assert len(holders) == 2, name  # the two tensor-parallel ranks of one stage
        if name.endswith("fc1.weight") or name.endswith("fc1.bias"):
            shards = [b["grads"][name] for b in sorted(holders, key=lambda b: b["tp"])]
            torch.testing.assert_close(torch.cat(shards), p.grad, msg=name)
        elif name.endswith("fc2.weight"):
            shards = [b["grads"][name] for b in sorted(holders, key=lambda b: b["tp"])]
            torch.testing.assert_close(torch.cat(shards, 1), p.grad, msg=name)
        else:
            for b in holders:
                torch.testing.assert_close(b["grads"][name], p.grad, msg=name)

    grouped = [r["group"] for r in results[2:]]
    for part, g in zip(ys.split(ROWS), grouped, strict=True):
        torch.testing.assert_close(g["y"], part)
    for g in grouped:  # both ranks of the group, and no other
        assert_captured(g["out"], out)


def test_sizes_above_one_without_a_process_group_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    model = MLP()
    with pytest.raises(RuntimeError, match="init_process_group"):
        FlexModel(model, {}, tensor_parallel_size=2)
    assert not dist.is_initialized()  # nothing was started behind the user's back
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.usefixtures("one_rank")
def test_layout_errors_name_the_numbers_and_the_fix() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match=r"2 x pipeline_parallel_size 1 x data_parallel_size 1 = 2.*1 rank"):
        make_layout(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="named among"):
        make_layout(device_mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("model",)))
    with pytest.raises(ValueError, match="disagrees with the device mesh"):
        make_layout(data_parallel_size=2, device_mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
    layout = make_layout(device_mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    assert (layout.tp_size, layout.dp_size, layout.pp_size, layout.is_root) == (1, 1, 1, True)


@pytest.mark.usefixtures("one_rank")
def test_ddp_wrapped_models_take_both_name_forms() -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(2, 8)
    expected = model.fc1(x)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(DistributedDataParallel(model), out)
    flex.register_forward_hook(HookFunction("fc1"))
    flex.register_forward_hook(HookFunction("module.fc1"))  # DDP's name form, as flex_model's users write it
    flex(x)
    torch.testing.assert_close(out["fc1"][0], expected.detach())
    torch.testing.assert_close(out["module.fc1"][0], expected.detach())
    torch.testing.assert_close(flex.get_module_parameter("fc2.bias"), model.fc2.bias.detach())
    torch.testing.assert_close(flex.get_module_parameter("module.fc2.bias"), model.fc2.bias.detach())
    flex.restore()
    assert not model.fc1._forward_hooks
