"""DistributedRouting end to end: data parallel hooks on gloo (DDP with unequal batches and
FSDP2 with equal ones) against one process on the whole batch; copies refused; the
routing plugs into flex through public names alone."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from _captures import assert_captured
from _faults import outcome, raises_on
from _models import MLP
from _spawn import spawn
from torch import nn

import torchsurgery
from torchsurgery import FlexModel, HookFunction

pytestmark = pytest.mark.distributed


def _case(rows: int) -> tuple[MLP, torch.Tensor, nn.Linear]:
    torch.manual_seed(0)
    return MLP(8, 16), torch.randn(rows, 8), nn.Linear(16, 16)


def _center(module: nn.Module, x: torch.Tensor, ctx: Any, modules: nn.ModuleDict) -> torch.Tensor:
    # depends on the whole batch: a data-parallel rank alone would get it wrong
    return x - x.mean(0, keepdim=True) + 0.1 * modules["probe"](x)


def _register(flex: FlexModel, probe: nn.Linear, fc2_edit: Any, *, grad_hook: bool = True, **fc2: Any) -> None:
    flex.register_trainable_module("probe", probe)
    flex.register_forward_hook(HookFunction("fc1"))
    flex.register_forward_hook(HookFunction("act", editing_function=_center))
    flex.register_forward_hook(HookFunction("fc2", editing_function=fc2_edit, **fc2))
    flex.register_full_backward_pre_hook(HookFunction("fc2"))
    if grad_hook:
        flex.register_hook(HookFunction("fc1.weight"))  # a parameter's gradient: averaged over replicas


def _local_center(module: nn.Module, x: torch.Tensor, ctx: Any, modules: Any) -> torch.Tensor:
    return x - x.mean(0, keepdim=True)


def _split_center(sizes: list[int]) -> Any:
    # the reference for edit_batch="local": each rank's rows centred on their own
    def edit(module: nn.Module, x: torch.Tensor, ctx: Any, modules: Any) -> torch.Tensor:
        return torch.cat([part - part.mean(0, keepdim=True) for part in x.split(sizes)])

    return edit


def _dp_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    result: dict[str, Any] = {}
    # DDP, unequal batches: rank 0 holds rows 0-2, rank 1 rows 3-4
    reference, x, probe = _case(5)
    rows = x[:3] if rank == 0 else x[3:]
    ddp = DistributedDataParallel(reference)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(ddp, out, data_parallel_size=world)
    _register(flex, probe, _local_center, edit_batch="local")
    y = flex(rows)
    (y**2).sum().backward()
    result["ddp"] = {
        "y": y.detach(), "out": out, "probe_grad": probe.weight.grad,
        "grads": {n: p.grad for n, p in reference.named_parameters()},
    }

    # one rank's edit raises: both fail, naming it
    flex.restore()
    failing = FlexModel(ddp, {}, data_parallel_size=world)
    failing.register_forward_hook(HookFunction("act", editing_function=raises_on(1)))
    result["failure"] = outcome(lambda: failing(rows))
    failing.restore()

    # FSDP2, equal batches
    reference, x, probe = _case(4)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    fully_shard(reference, mesh=mesh)
    out = {}
    flex = FlexModel(reference, out, device_mesh=mesh)
    try:
        flex.register_hook(HookFunction("fc1.weight"))
        result["fsdp_grad_hook"] = "no error"
    except ValueError as exc:
        result["fsdp_grad_hook"] = str(exc)
    _register(flex, probe, lambda m, t, c, mods: t * 1.5, grad_hook=False)
    y = flex(x.chunk(world)[rank])
    (y**2).sum().backward()
    result["fsdp"] = {
        "y": y.detach(), "out": out, "probe_grad": probe.weight.grad,
        "grads": {n: p.grad.full_tensor() for n, p in reference.named_parameters()},
        "fc1_weight": flex.get_module_parameter("fc1.weight"),
    }
    return result


def _reference(rows: int, fc2_edit: Any) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]], MLP, nn.Linear]:
    model, x, probe = _case(rows)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    _register(flex, probe, fc2_edit)
    y = flex(x)
    # DDP and FSDP2 average the 2 replicas' gradients of their summed losses
    ((y**2).sum() / 2).backward()
    return y.detach(), out, model, probe


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_dp_worker, 2)


@pytest.mark.parametrize(("wrapper", "rows", "sizes"), [("ddp", 5, [3, 2]), ("fsdp", 4, [2, 2])])
def test_data_parallel_matches_one_process(results: list[dict[str, Any]], wrapper: str, rows: int, sizes: list[int]) -> None:
    edit = _split_center(sizes) if wrapper == "ddp" else (lambda m, t, c, mods: t * 1.5)
    y, out, model, probe = _reference(rows, edit)
    got = [r[wrapper] for r in results]
    torch.testing.assert_close(torch.cat([g["y"] for g in got]), y)
    # every rank holds the captures, the whole batch in rank order; forward and backward
    expected = ["fc1", "act", "fc2", "fc2#2", "fc1.weight"][: 5 if wrapper == "ddp" else 4]
    for g in got:
        assert_captured(g["out"], {key: out[key] for key in expected})
    for g in got:
        torch.testing.assert_close(g["probe_grad"], probe.weight.grad)
        for name, p in model.named_parameters():
            torch.testing.assert_close(g["grads"][name], p.grad, msg=name)
    if wrapper == "fsdp":
        for g in got:
            torch.testing.assert_close(g["fc1_weight"], model.fc1.weight.detach())
        for r in results:  # FSDP2 assigns gradients directly: a gradient hook would never run
            assert "param.grad.full_tensor()" in r["fsdp_grad_hook"]


def test_a_failing_edit_stops_every_rank(results: list[dict[str, Any]]) -> None:
    assert results[0]["failure"].startswith("RuntimeError") and "rank(s) [1]" in results[0]["failure"]
    assert "'act'" in results[0]["failure"]
    assert results[1]["failure"].startswith("ValueError: boom on purpose")


# Gradients at DP=2 and DP=4 with unequal batches: each replica's loss is the mean over its
# rows, DDP averages the replicas, so the reference is one process on the whole batch with
# the mean of the replicas' mean losses. Captures and edits must see that process's
# activations and gradients, of activations and of parameters, under both name forms.

_SIZES = {2: [3, 1], 4: [1, 3, 2, 1]}


def _clip(module: nn.Module, g: torch.Tensor, ctx: Any, modules: Any) -> torch.Tensor:
    # not linear: a gradient seen at the wrong scale is clipped differently
    return g.clamp(-0.01, 0.01)


def _sqrt(module: nn.Module, g: torch.Tensor, ctx: Any, modules: Any) -> torch.Tensor:
    return g.sign() * g.abs().sqrt() * 0.1


def _grad_hooks(flex: FlexModel, prefix: str) -> None:
    flex.register_forward_hook(HookFunction(prefix + "fc1", editing_function=_local_center))  # the global batch
    flex.register_full_backward_hook(HookFunction(prefix + "act", editing_function=_clip))
    flex.register_full_backward_pre_hook(HookFunction(prefix + "fc2"))
    flex.register_hook(HookFunction(prefix + "fc1.weight", editing_function=_sqrt))
    flex.register_hook(HookFunction(prefix + "fc2.bias"))


def _mean_of_means(y: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    return torch.stack([part.pow(2).mean() for part in y.split(sizes)]).mean()


def _grad_worker(rank: int, world: int, prefix: str, captures_on: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model, x = MLP(8, 16), torch.randn(sum(_SIZES[world]), 8)
    rows = x.split(_SIZES[world])[rank]
    ddp = DistributedDataParallel(model)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(ddp, out, data_parallel_size=world, captures_on=captures_on)  # type: ignore[arg-type]
    _grad_hooks(flex, prefix)
    flex(rows).pow(2).mean().backward()
    return {"out": out, "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize(
    ("world", "prefix", "captures_on"),
    [(2, "module.", "every_rank"), (2, "", "first_rank"), pytest.param(4, "", "first_rank", marks=pytest.mark.slow)],
)
def test_gradient_captures_and_edits_match_one_process(world: int, prefix: str, captures_on: str) -> None:
    results = spawn(_grad_worker, world, prefix, captures_on)
    torch.manual_seed(0)
    model, x = MLP(8, 16), torch.randn(sum(_SIZES[world]), 8)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    _grad_hooks(flex, "")
    _mean_of_means(flex(x), _SIZES[world]).backward()
    holders = range(world) if captures_on == "every_rank" else [0]
    for rank, r in enumerate(results):
        got = r["out"]
        if rank in holders:
            assert sorted(got) == sorted(prefix + key for key in out)  # keys as the hooks name them
            for key in out:
                torch.testing.assert_close(got[prefix + key][0], out[key][0], msg=key)
        else:
            assert got == {}
        for name, p in model.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, msg=name)


@pytest.mark.usefixtures("one_rank")
def test_a_distributed_wrapper_refuses_copies_with_a_reason() -> None:
    import copy
    import pickle

    import torch.distributed as dist

    model = MLP(8, 16)
    flex = FlexModel(model, {}, process_group=dist.group.WORLD)
    flex.register_forward_hook(HookFunction("fc1"))
    for attempt in (lambda: copy.deepcopy(flex), lambda: pickle.dumps(flex), lambda: copy.deepcopy(model)):
        with pytest.raises(TypeError, match="process groups belong to this process"):
            attempt()
    flex.restore()
    assert copy.deepcopy(model).fc1._forward_hooks == {}


def test_the_parallel_backend_imports_only_public_names_of_other_modules() -> None:
    root = Path(torchsurgery.__file__).parent
    private = []
    paths = sorted((root / "flex" / "parallel").glob("*.py"))
    assert len(paths) > 10  # the backend's modules are there
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module or not node.module.startswith("torchsurgery."):
                continue
            parts = node.module.split(".")
            if parts[1:3] == ["flex", "parallel"]:
                continue  # its own modules
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in parts[2:]) or any(n.startswith("_") for n in names):
                private.append(f"{path.name}: from {node.module} import {', '.join(names)}")
    assert private == []
