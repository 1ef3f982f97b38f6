"""Hooks and torch.compile: changes after a compiled call take effect."""

from __future__ import annotations

import torch
from torch import nn

from torchsurgery import FlexModel, HookFunction


def test_hooks_and_groups_changed_after_a_compiled_call_take_effect() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    x = torch.randn(2, 3)
    compiled = torch.compile(model, backend="eager")
    plain = model(x).detach()
    edited = model[2](model[1](model[0](x) * 0)).detach()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), plain)  # compiled with no hooks at all
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(compiled, out)
    zero = HookFunction("0", editing_function=lambda m, t, c, mods: t * 0)
    flex.register_forward_hook(zero)
    flex.create_hook_group("zero", zero)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), edited)  # the hook added after compiling runs
        torch.testing.assert_close(flex(x, groups="zero", complement=True), plain)  # groups per call
        torch.testing.assert_close(flex(x, groups="zero"), edited)
        torch.testing.assert_close(flex(x, groups="zero", complement=True), plain)
    assert len(out["0"]) == 2
    flex.restore()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), plain)  # and removed ones stop


def test_compiling_a_flex_model_warns_of_nothing_and_compiles_once() -> None:
    """The compiler traces the hooks' way out of the graph without a warning (a cached function
    there had it warn "Dynamo detected a call to a functools.lru_cache-wrapped function") and
    without a guard that fails on the next call (a function kept in a global had one)."""
    import warnings

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    edited = model[2](model[1](model[0](x) * 2)).detach()
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_forward_hook(HookFunction("0", editing_function=lambda m, t, c, mods: t * 2))
    compiled = torch.compile(flex, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        warnings.simplefilter("always")
        results = [compiled(x) for _ in range(3)]  # and compiled once
    assert [str(w.message) for w in caught] == []
    for result in results:
        torch.testing.assert_close(result, edited)
    assert len(out["0"]) == 3
    flex.restore()
    torch._dynamo.reset()
