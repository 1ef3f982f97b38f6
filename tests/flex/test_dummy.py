"""DummyModule: an identity that gives a value inside a forward a hookable name."""

from __future__ import annotations

import torch
from torch import nn

from torchsurgery import DummyModule, FlexModel, HookFunction


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.sum = DummyModule()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sum(x + self.fc(x)) * 2


def test_dummy_module_exposes_an_inner_value_to_capture_and_edit() -> None:
    torch.manual_seed(0)
    model = Residual()
    x = torch.randn(2, 3)
    inner = (x + model.fc(x)).detach()
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_forward_hook(HookFunction("sum", editing_function=lambda m, t, c, mods: t + 1))
    y = flex(x)
    torch.testing.assert_close(out["sum"][0], inner)
    torch.testing.assert_close(y, (inner + 1) * 2)
    flex.restore()
    torch.testing.assert_close(model(x), inner * 2)
    assert model.sum(x) is x
