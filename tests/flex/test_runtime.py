"""The hook runtime: the chosen tensor out of any output structure, edited, put back;
shapes checked."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import pytest
import torch
from _flex_models import IDS, double, tiny_gpt2, transformers
from torch import nn

from torchsurgery import FlexModel, HookFunction, ShapeHintWarning


def test_pre_hook_reads_and_edits_keyword_inputs() -> None:
    inner = nn.Linear(3, 3)

    class Caller(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(input=x)  # the activation arrives as a keyword

    x = torch.randn(2, 3)
    expected = inner(x * 2)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(Caller(), out)
    flex.register_forward_pre_hook(HookFunction("inner", editing_function=double))
    torch.testing.assert_close(flex(x), expected)
    torch.testing.assert_close(out["inner"][0], x)
    flex.restore()


Pair = namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Result:
    hidden: torch.Tensor
    extra: torch.Tensor
    note: str = "kept"


class Structured(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> Any:
        a, b = self.lin(x), x + 1
        if self.kind == "dict":
            return {"a": a, "b": b}
        if self.kind == "namedtuple":
            return Pair(a, b)
        if self.kind == "dataclass":
            return Result(a, b)
        if self.kind == "list":
            return [a, b]
        return (a, (b, "text"))


@pytest.mark.parametrize("kind", ["dict", "namedtuple", "dataclass", "list", "nested"])
@pytest.mark.parametrize("idx", [0, 1])
def test_any_output_structure_is_captured_and_repacked(kind: str, idx: int) -> None:
    module = Structured(kind)
    x = torch.randn(2, 3)
    plain = module(x)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(module, out)
    flex.register_forward_hook(HookFunction("", editing_function=double, unpack_idx=idx))
    edited = flex(x)
    assert type(edited) is type(plain)
    from torchsurgery.flex.pytree import flatten

    before, _ = flatten(plain)
    after, _ = flatten(edited)
    torch.testing.assert_close(out[""][0], before[idx])
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        torch.testing.assert_close(a, b * 2 if i == idx else b)
    if kind == "dataclass":
        assert edited.note == "kept"
    flex.restore()


def test_model_output_objects_are_captured() -> None:
    model = tiny_gpt2()
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_forward_hook(HookFunction(""))  # the root returns a ModelOutput
    result = flex(IDS)
    assert isinstance(result, transformers.modeling_outputs.CausalLMOutputWithCrossAttentions)
    torch.testing.assert_close(out[""][0], result.logits)
    flex.restore()


def test_expected_shape_and_shape_changes_are_checked() -> None:
    model = tiny_gpt2()
    flex = FlexModel(model, {})
    flex.register_forward_hook(HookFunction("transformer.h.0.mlp", expected_shape=(None, None, 99)))
    # as in flex_model, a hint nothing needs does not stop the run: it is told once
    with pytest.warns(ShapeHintWarning, match=r"\[None, None, 99\] of 'transformer.h.0.mlp' does not match its shape \[1, 5, 16\]"):
        flex(IDS)
    flex.restore()
    flex = FlexModel(model, {})
    flex.register_forward_hook(HookFunction("transformer.h.0.mlp", expected_shape=(1, 5, None)))
    flex(IDS)
    flex.restore()

    def shrink(m: nn.Module, x: torch.Tensor, ctx: Any, modules: nn.ModuleDict) -> torch.Tensor:
        return x[..., :4]

    flex = FlexModel(nn.Sequential(nn.Linear(3, 8)), {})
    flex.register_forward_hook(HookFunction("0", editing_function=shrink))
    with pytest.raises(ValueError, match="changed the shape"):
        flex(torch.randn(2, 3))
    flex.restore()
    flex = FlexModel(nn.Sequential(nn.Linear(3, 8)), {})
    flex.register_forward_hook(HookFunction("0", editing_function=shrink, allow_shape_change=True))
    assert flex(torch.randn(2, 3)).shape == (2, 4)
    flex.restore()


def test_unpack_idx_past_the_last_tensor_names_the_hook_and_the_count() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    flex = FlexModel(model, {})
    flex.register_forward_hook(HookFunction("0", unpack_idx=1))
    with pytest.raises(IndexError, match="hook on '0' has unpack_idx=1, but the forward value holds only 1 tensor"):
        flex(torch.ones(1, 2))
    flex.restore()


def test_an_editing_function_returning_no_tensor_is_named() -> None:
    flex = FlexModel(nn.Sequential(nn.Linear(2, 2)), {})
    flex.register_forward_hook(HookFunction("0", editing_function=lambda m, t, c, mods: t.tolist()))
    with pytest.raises(TypeError, match="editing function of the hook on '0' returned list; it must return a Tensor"):
        flex(torch.ones(1, 2))
    flex.restore()
