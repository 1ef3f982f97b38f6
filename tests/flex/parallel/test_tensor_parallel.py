"""Tensor parallel hooks on gloo: a hand-made column/row-parallel MLP (with expected_shape)
and a transformers Llama parallelised with DTensor (no hints), against one process."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _captures import assert_captured
from _faults import outcome, raises_on
from _models import MLP, tensor_parallel_mlp
from _spawn import spawn
from torch import nn

from torchsurgery import FlexModel, HookFunction, ShapeHintWarning

pytestmark = pytest.mark.distributed
HIDDEN = 16


def _mlp_case() -> tuple[MLP, torch.Tensor, nn.Linear]:
    torch.manual_seed(0)
    return MLP(8, HIDDEN), torch.randn(3, 5, 8), nn.Linear(HIDDEN, HIDDEN)


def _probe_edit(module: nn.Module, x: torch.Tensor, ctx: Any, modules: nn.ModuleDict) -> torch.Tensor:
    return x + 0.5 * modules["probe"](x)


def _run_mlp(flex: FlexModel, x: torch.Tensor, probe: nn.Linear) -> torch.Tensor:
    flex.register_trainable_module("probe", probe)
    flex.register_forward_hook(HookFunction("fc1", (None, None, HIDDEN), _probe_edit))
    flex.register_forward_hook(HookFunction("fc2"))
    flex.register_full_backward_pre_hook(HookFunction("fc1", (None, None, HIDDEN)))
    y = flex(x)
    (y**2).sum().backward()
    return y


def _tp_mlp_worker(rank: int, world: int) -> dict[str, Any]:
    reference, x, probe = _mlp_case()
    model = tensor_parallel_mlp(reference, rank, world)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out, tensor_parallel_size=world)
    y = _run_mlp(flex, x, probe)
    result: dict[str, Any] = {
        "y": y.detach(),
        "out": out,
        "fc1_weight_grad": model.fc1.weight.grad,
        "fc2_weight_grad": model.fc2.weight.grad,
        "probe_grad": probe.weight.grad,
        "fc1_weight": flex.get_module_parameter("fc1.weight", (HIDDEN, None)),
    }

    # one rank's editing function raises: every rank fails, naming it, and nobody hangs
    flex.restore()
    failing = FlexModel(model, {}, tensor_parallel_size=world)
    failing.register_forward_hook(HookFunction("fc1", (None, None, HIDDEN), raises_on(1)))
    result["failure"] = outcome(lambda: failing(x))
    failing.restore()

    # a random edit run once and broadcast: every rank continues with the same values
    torch.manual_seed(100 + rank)
    noisy = FlexModel(model, {}, tensor_parallel_size=world)
    noisy.register_forward_hook(HookFunction(
        "fc1", (None, None, HIDDEN), lambda m, t, c, mods: t + torch.randn_like(t), edit_on="rank0"
    ))
    gathered = [torch.empty(3, 5, 8) for _ in range(world)]
    dist.all_gather(gathered, noisy(x).detach())
    result["rank0_edit_agrees"] = all(torch.equal(gathered[0], g) for g in gathered)
    noisy.restore()

    # a hint that names no sharded dimension is told once, not raised; one that must shard but cannot, raised
    hinted = FlexModel(model, {}, tensor_parallel_size=world)
    hinted.register_forward_hook(HookFunction("fc2", (None, None, None, None)))  # fc2's output is whole
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hinted(x)
        hinted(x)
        hinted.get_module_parameter("fc2.bias", (None, None))
    result["hints"] = [str(w.message) for w in caught if w.category is ShapeHintWarning]
    result["bad_hint"] = outcome(lambda: hinted.get_module_parameter("fc2.bias", (99,)))
    hinted.restore()

    try:
        FlexModel(model, {}, tensor_parallel_size=3)
        result["size_error"] = "no error"
    except ValueError as exc:
        result["size_error"] = str(exc)
    result["hooks_left"] = sum(len(m._forward_hooks) + len(m._backward_pre_hooks) for m in model.modules())
    return result


def test_tensor_parallel_mlp_matches_one_process() -> None:
    results = spawn(_tp_mlp_worker, 2)
    reference, x, probe = _mlp_case()
    out: dict[str, list[torch.Tensor]] = {}
    y = _run_mlp(FlexModel(reference, out), x, probe)
    got = results[0]

    torch.testing.assert_close(got["y"], y.detach())
    assert sorted(out) == ["fc1", "fc1#2", "fc2"]
    for r in results:  # each tensor-parallel rank holds the unsharded captures
        assert_captured(r["out"], out)
    # each rank holds its shard of the gradients; together they are one process's
    torch.testing.assert_close(torch.cat([r["fc1_weight_grad"] for r in results], 0), reference.fc1.weight.grad)
    torch.testing.assert_close(torch.cat([r["fc2_weight_grad"] for r in results], 1), reference.fc2.weight.grad)
    for r in results:
        torch.testing.assert_close(r["probe_grad"], probe.weight.grad)
        torch.testing.assert_close(r["fc1_weight"], reference.fc1.weight.detach())
        assert "rank(s) [1]" in r["failure"] and "'fc1'" in r["failure"], r["failure"]
        assert r["rank0_edit_agrees"] is True
        assert "3 x pipeline_parallel_size 1 x data_parallel_size 1 = 3" in r["size_error"]
        assert "2 rank(s)" in r["size_error"]
        assert r["hooks_left"] == 0
        assert len(r["hints"]) == 2, r["hints"]
        assert "[None, None, None, None] of 'fc2' does not match its shape [3, 5, 8]" in r["hints"][0]
        assert "[None, None] of 'fc2.bias' does not match its shape [8]" in r["hints"][1]
        assert all("the hint names no sharded dimension" in m for m in r["hints"])
        assert "expected_shape[0] is 99, but this rank holds 8 of it with tensor_parallel_size 2" in r["bad_hint"]
    assert results[1]["failure"].startswith("ValueError: boom on purpose")


def _llama() -> tuple[nn.Module, torch.Tensor]:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    return model, torch.randint(0, 64, (2, 6))


def _hook_llama(flex: FlexModel) -> None:
    def double(module: nn.Module, x: torch.Tensor, ctx: Any, modules: Any) -> torch.Tensor:
        ctx.up_shapes = [*getattr(ctx, "up_shapes", []), tuple(x.shape)]
        return x * 2

    flex.register_forward_hook(HookFunction("model.layers.*.self_attn.q_proj"))  # column-parallel
    flex.register_forward_hook(HookFunction("model.layers.*.self_attn.o_proj"))  # row-parallel
    flex.register_forward_hook(HookFunction("model.layers.*.mlp.up_proj", editing_function=double))
    flex.register_forward_hook(HookFunction("model.layers.*.mlp"))  # a block: whole
    flex.register_forward_pre_hook(HookFunction("model.layers.0.mlp.down_proj"))  # a DTensor input


def _tp_llama_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model, ids = _llama()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = {f"model.layers.*.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan.update({"model.layers.*.mlp.gate_proj": ColwiseParallel(), "model.layers.*.mlp.up_proj": ColwiseParallel()})
    plan.update({"model.layers.*.self_attn.o_proj": RowwiseParallel(), "model.layers.*.mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out, device_mesh=mesh)
    _hook_llama(flex)
    logits = flex(ids).logits
    logits.float().pow(2).mean().backward()
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for name, p in model.named_parameters()
    }
    return {
        "logits": logits.detach(),
        "out": out,
        "grads": grads,
        "up_shapes": flex.save_ctx.up_shapes,
        "q_weight": flex.get_module_parameter("model.layers.0.self_attn.q_proj.weight"),
        "tp_size": flex.tp_size,
    }


def test_dtensor_llama_needs_no_hints() -> None:
    results = spawn(_tp_llama_worker, 2)
    model, ids = _llama()
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    _hook_llama(flex)
    logits = flex(ids).logits
    logits.float().pow(2).mean().backward()
    got = results[0]

    torch.testing.assert_close(got["logits"], logits.detach())
    assert got["tp_size"] == 2
    for r in results:
        assert_captured(r["out"], out)  # on both tensor-parallel ranks, unsharded
        assert r["up_shapes"] == flex.save_ctx.up_shapes  # the edit saw full tensors
        torch.testing.assert_close(r["q_weight"], model.model.layers[0].self_attn.q_proj.weight.detach())
        for name, p in model.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, msg=name)
