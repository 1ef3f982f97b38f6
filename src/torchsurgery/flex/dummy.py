"""``DummyModule``: an identity module that gives a value inside a forward a name to hook."""

from __future__ import annotations

from typing import Any

from torch import nn


class DummyModule(nn.Module):
    """Return its input unchanged, so a hook can capture or edit it by this module's name.

    A value computed inside a ``forward`` (a sum of two branches, the result of calling
    a submodule's ``forward`` directly) runs through no module, so no hook sees it.
    Passing it through a ``DummyModule`` attribute gives it a name. Same as
    ``flex_model.core.DummyModule``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> class Residual(nn.Module):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.fc = nn.Linear(2, 2)
        ...         self.sum = torchsurgery.DummyModule()
        ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
        ...         return self.sum(x + self.fc(x))
        >>> out = {}
        >>> flex = torchsurgery.FlexModel(Residual(), out)
        >>> flex.register_forward_hook(torchsurgery.HookFunction("sum"))
        >>> y = flex(torch.ones(1, 2))
        >>> torch.equal(out["sum"][0], y)
        True
        >>> _ = flex.restore()
    """

    def forward(self, inputs: Any) -> Any:
        """Return ``inputs`` as they are."""
        return inputs
