"""flex_model's two module trees: the wrapped model and the trainable modules.

A FlexModel acts on both at once: ``state_dict()`` holds the model under ``module.`` and the
trainable modules under ``trainable_modules.`` (flex_model's keys, so a saved wrapper keeps
what its hooks trained), ``load_state_dict()`` loads both, and ``to()``, ``train()``...
reach both. ``named_parameters()`` keeps the model's own names (see
:mod:`torchsurgery.flex.surface`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchsurgery.flex.runtime import HookRuntime

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["ModelAndTrainables"]


class ModelAndTrainables(nn.Module):
    """The wrapped ``module`` and the trainable modules its hooks' editing functions use.

    Example:
        >>> import torchsurgery
        >>> flex = torchsurgery.FlexModel(nn.Linear(2, 2), {})
        >>> flex.register_trainable_module("steer", nn.Linear(2, 2))
        >>> flex.trainable_modules_names, flex.train(False).trainable_modules.steer.training
        (['steer'], False)
    """

    module: nn.Module
    _runtime: HookRuntime

    @property
    def trainable_modules(self) -> nn.ModuleDict:
        """Modules every editing function receives as ``modules``; train them with backward."""
        return self._runtime.trainable_modules

    @property
    def trainable_modules_names(self) -> list[str]:
        """Names of the registered trainable modules."""
        return list(self.trainable_modules.keys())

    def _layout(self) -> nn.Module:
        """flex_model's module tree: the model as child ``module``, the trainable modules as
        ``trainable_modules``; what its ``state_dict`` keys are made of. The wrapper itself
        cannot be it: it shares the model's child dict, so the model's children are its own."""
        layout = nn.Module()
        layout.module = self.module
        layout.trainable_modules = self.trainable_modules
        return layout

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model and the trainable modules, under flex_model's keys.

        ``module.<name>`` for each entry of the wrapped model's ``state_dict`` and
        ``trainable_modules.<module>.<name>`` for each trainable module's, as
        ``flex_model.core.FlexModel.state_dict`` has them, so what a program trained through
        its hooks is saved with the model. ``named_parameters()`` keeps the model's own names.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> import torchsurgery
            >>> flex = torchsurgery.FlexModel(nn.Sequential(nn.Linear(2, 2)), {})
            >>> flex.register_trainable_module("steer", nn.Linear(2, 2, bias=False))
            >>> list(flex.state_dict())
            ['module.0.weight', 'module.0.bias', 'trainable_modules.steer.weight']
            >>> flex.load_state_dict(flex.state_dict())
            <All keys matched successfully>
        """
        return self._layout().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a :meth:`state_dict` (ours or flex_model's: the same keys) into the model and
        the trainable modules; register the trainable modules first.

        Raises:
            RuntimeError: with ``strict``, keys are missing or unexpected (named, with the
                fix when the keys are the bare model's).
        """
        try:
            return self._layout().load_state_dict(state_dict, strict=strict, assign=assign)
        except RuntimeError as exc:
            fix = ""
            if state_dict and set(state_dict) <= set(self.module.state_dict()):
                fix = ("; these are the wrapped model's own keys (no 'module.' prefix): load them with "
                       "flex.module.load_state_dict(state_dict)")
            elif any(key.startswith("trainable_modules.") for key in state_dict):
                fix = "; register each trainable module (flex.register_trainable_module) before loading"
            raise RuntimeError(f"torchsurgery.FlexModel.load_state_dict: {str(exc).strip()}{fix}") from None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        self.module._apply(fn, recurse)
        self.trainable_modules._apply(fn, recurse)
        return self

    def train(self, mode: bool = True) -> Self:
        """Set training mode on the wrapped model and the trainable modules."""
        self.module.train(mode)
        self.trainable_modules.train(mode)
        self.training = mode
        return self
