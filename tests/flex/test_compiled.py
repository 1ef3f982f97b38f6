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
