"""Pipeline parallel hooks on gloo: a model split in two stages that keep their names."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _captures import assert_captured
from _faults import outcome, raises_on
from _models import Stack, stage_of
from _spawn import spawn

from torchsurgery import FlexModel, HookFunction

pytestmark = pytest.mark.distributed


def _case() -> tuple[Stack, torch.Tensor]:
    torch.manual_seed(0)
    return Stack(4, 8), torch.randn(3, 8)


def _register(flex: FlexModel) -> None:
    flex.register_forward_hook(HookFunction("layers.*"))  # each stage hooks the layers it holds
    flex.register_forward_hook(HookFunction("layers.3.fc1", editing_function=lambda m, x, c, mods: -x))
    flex.register_forward_hook(HookFunction("head"))  # held by the last stage alone


def _register_training(flex: FlexModel) -> None:
    flex.register_forward_hook(HookFunction("layers.*"))
    flex.register_forward_hook(HookFunction("layers.2.fc1", editing_function=lambda m, x, c, mods: 0.5 * x))
    flex.register_full_backward_pre_hook(HookFunction("layers.*"))  # gradients of every block's output


def _pp_backward_worker(rank: int, world: int) -> dict[str, Any]:
    model, x = _case()
    stage = stage_of(model, rank, world)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(stage, out, pipeline_parallel_size=world)
    _register_training(flex)
    y = flex(x)
    flex.backward((y**2).sum() if y is not None else None)
    return {"out": out, "grads": {n: p.grad for n, p in stage.named_parameters()}}


def test_backward_runs_through_every_stage() -> None:
    results = spawn(_pp_backward_worker, 2)
    model, x = _case()
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    _register_training(flex)
    flex.backward((flex(x) ** 2).sum())

    grads = {**results[0]["grads"], **results[1]["grads"]}
    assert sorted(grads) == sorted(n for n, _ in model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    assert len(out) == 9  # 4 blocks + the edit, then 4 gradients
    for r in results:  # both stages hold both stages' captures
        got = r["out"]
        assert sorted(got) == sorted(out)
        for key, values in out.items():
            assert len(got[key]) == 1, key
            torch.testing.assert_close(got[key][0], values[0], msg=key)


def _pp_worker(rank: int, world: int) -> dict[str, Any]:
    model, x = _case()
    stage = stage_of(copy.deepcopy(model), rank, world)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(stage, out, pipeline_parallel_size=world)
    _register(flex)
    result: dict[str, Any] = {"y": flex(x), "out": {k: list(v) for k, v in out.items()}}
    # a group made by name holds different hooks on each stage (none on stage 0)
    flex.create_hook_group("heads", "head")
    out.clear()
    flex(x, groups="heads")
    result["group_keys"] = list(out)
    try:
        flex.register_forward_hook(HookFunction("layers.9"))
        result["typo"] = "no error"
    except ValueError as exc:
        result["typo"] = str(exc)

    # an edit fails on stage 0: stage 1 is told instead of waiting, and both raise
    failing = FlexModel(stage_of(copy.deepcopy(model), rank, world), {}, pipeline_parallel_size=world)
    failing.register_forward_hook(HookFunction("layers.0", editing_function=raises_on(None)))
    result["failure"] = outcome(lambda: failing(x))
    # an edit fails on the last stage: rank 0, which collects the captures, raises too
    late = FlexModel(stage_of(copy.deepcopy(model), rank, world), {}, pipeline_parallel_size=world)
    late.register_forward_hook(HookFunction("layers.3", editing_function=raises_on(None)))
    result["late_failure"] = outcome(lambda: late(x))
    out.clear()
    result["again"] = flex(x)  # the first wrapper still works after the failure
    result["again_keys"] = list(out)
    return result


def test_two_stages_match_one_process() -> None:
    results = spawn(_pp_worker, 2)
    model, x = _case()
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    _register(flex)
    y = flex(x)

    assert results[0]["y"] is None  # the output comes out of the last stage
    torch.testing.assert_close(results[1]["y"], y)
    torch.testing.assert_close(results[1]["again"], y)
    assert list(out) == ["layers.0", "layers.1", "layers.2", "layers.3.fc1", "layers.3", "head"]
    for r in results:  # in stage order, on both stages
        assert_captured(r["out"], out)
        assert r["group_keys"] == ["head#2"]  # "head" already had a hook
        assert r["again_keys"] == [*out, "head#2"]
    for r in results:
        assert "'layers.9' matches no submodule" in r["typo"]
    assert results[0]["failure"].startswith("ValueError: boom on purpose")
    assert results[1]["failure"].startswith("RuntimeError") and "stage 0 failed" in results[1]["failure"]
    assert results[0]["late_failure"].startswith("RuntimeError") and "rank(s) [1] failed" in results[0]["late_failure"]
    assert results[1]["late_failure"].startswith("ValueError: boom on purpose")
