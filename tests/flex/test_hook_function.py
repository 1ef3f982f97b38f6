"""HookFunction: its arguments, its keys when several share a module, reuse across
wrappers, and its use as a plain torch hook."""

from __future__ import annotations

import copy

import pytest
import torch
from _flex_models import IDS, double, tiny_gpt2
from torch import nn

from torchsurgery import FlexModel, HookFunction


def test_hook_function_is_callable_as_a_torch_hook() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    x = torch.randn(2, 3)
    # reference: plain torch hooks doubling both Linear outputs, on a copy
    reference = copy.deepcopy(model)
    reference[0].register_forward_hook(lambda m, a, o: o * 2)
    reference[2].register_forward_hook(lambda m, a, o: o * 2)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    hook = HookFunction("0", editing_function=double)
    with pytest.raises(RuntimeError, match="register it first"):
        hook(model[2], (x,), x)
    flex.register_forward_hook(hook)
    handle = model[2].register_forward_hook(hook)  # flex_model code hands it to torch directly
    torch.testing.assert_close(flex(x), reference(x))
    assert len(out["0"]) == 2  # both calls capture under the hook's key
    flex.create_hook_group("none", [])
    flex(x, groups="none")  # groups apply to the direct use too
    assert len(out["0"]) == 2
    handle.remove()
    flex.restore()
    with pytest.raises(RuntimeError, match="restored"):
        hook(model[2], (x,), x)


def test_two_hooks_on_one_module_stay_distinct_and_hooks_are_reusable() -> None:
    model = tiny_gpt2()
    out1: dict[str, list[torch.Tensor]] = {}
    out2: dict[str, list[torch.Tensor]] = {}
    capture = HookFunction("transformer.h.0.mlp")
    edit = HookFunction("transformer.h.0.mlp", editing_function=double)
    flex1 = FlexModel(model, out1)
    flex1.register_forward_hook(capture)
    flex1.register_forward_hook(edit)
    flex1(IDS)
    assert sorted(out1) == ["transformer.h.0.mlp", "transformer.h.0.mlp#2"]
    torch.testing.assert_close(out1["transformer.h.0.mlp"][0], out1["transformer.h.0.mlp#2"][0])
    flex1.restore()
    flex2 = FlexModel(model, out2)
    flex2.register_forward_hook(capture)  # the same HookFunction in a second wrapper
    flex2(IDS)
    torch.testing.assert_close(out2["transformer.h.0.mlp"][0], out1["transformer.h.0.mlp"][0])
    flex2.restore()


def test_bad_arguments_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="expected_shape"):
        HookFunction("x", expected_shape=(1, "a"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected_shape must be a sequence of sizes or None, e.g. \\(None, 16\\), got 5"):
        HookFunction("x", expected_shape=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        HookFunction("x", editing_function=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="edit_on must be 'all' or 'rank0', got 'rank1'"):
        HookFunction("x", edit_on="rank1")
    with pytest.raises(ValueError, match="edit_batch must be 'global' or 'local'"):
        HookFunction("x", edit_batch="everything")
    with pytest.raises(ValueError, match="unpack_idx must be an int >= 0, got -1"):
        HookFunction("x", unpack_idx=-1)
    with pytest.raises(TypeError, match="module_name must be a str, got 3"):
        HookFunction(3)  # type: ignore[arg-type]


def test_edits_tells_an_editing_hook_from_a_capture() -> None:
    assert not HookFunction("x").edits
    assert HookFunction("x", editing_function=double).edits
    assert "edits=True" in repr(HookFunction("x", (None, 4), double))
