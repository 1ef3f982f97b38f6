"""A wrapper whose module surface *is* the wrapped model's.

A :class:`SharedSurface` shares the wrapped model's parameter, buffer and child
dictionaries (it does not hold the model as a child, so names carry no ``module.``
prefix): ``parameters()``, ``named_modules()``, ``to()``... act on the model with its own
names, and attributes the wrapper lacks (``config``, ``generate``) are read from the
model. A module, parameter or buffer set on the wrapper would therefore land in the model
and outlive the wrapper: that is refused, with the way to do it instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["SharedSurface"]


class SharedSurface(nn.Module):
    """An ``nn.Module`` sharing ``module``'s parameters, buffers and children.

    Args:
        module: the model whose dictionaries become this module's (held as ``module``, not
            as a child).

    Example:
        >>> model = nn.Linear(2, 2)
        >>> wrapper = SharedSurface(model)
        >>> [name for name, _ in wrapper.named_parameters()], wrapper.in_features
        (['weight', 'bias'], 2)
        >>> wrapper.probe = nn.Linear(1, 1)
        Traceback (most recent call last):
        ...
        TypeError: torchsurgery.FlexModel.__setattr__: 'probe' would become part of the wrapped model ...
    """

    module: nn.Module

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        d = self.__dict__
        d["module"] = module
        d["_modules"] = module._modules
        d["_parameters"] = module._parameters
        d["_buffers"] = module._buffers
        d["_non_persistent_buffers_set"] = module._non_persistent_buffers_set

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # attributes of the wrapped model (config, generate, ...) read through the wrapper
            return getattr(self.__dict__["module"], name)

    def _refuse(self, what: str, name: str) -> None:
        raise TypeError(
            f"torchsurgery.FlexModel.{what}: {name!r} would become part of the wrapped model "
            "(the wrapper shares its modules, parameters and buffers) and outlive restore(); "
            f"use flex.register_trainable_module({name!r}, module) for a module editing functions "
            "use, or change the model itself through flex.module"
        )

    def _shared_name(self, name: str) -> bool:
        d = self.__dict__
        return name in d["_modules"] or name in d["_parameters"] or name in d["_buffers"]

    def __setattr__(self, name: str, value: Any) -> None:
        if "module" in self.__dict__ and (isinstance(value, (nn.Module, nn.Parameter)) or self._shared_name(name)):
            self._refuse("__setattr__", name)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self._shared_name(name):
            self._refuse("__delattr__", name)
        super().__delattr__(name)

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        """Refused: a buffer on the wrapper would be the wrapped model's (see ``__setattr__``)."""
        self._refuse("register_buffer", name)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """Refused: a parameter on the wrapper would be the wrapped model's."""
        self._refuse("register_parameter", name)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        """Refused: a submodule on the wrapper would be the wrapped model's."""
        self._refuse("add_module", name)

    def register_module(self, name: str, module: nn.Module | None) -> None:
        """Refused: a submodule on the wrapper would be the wrapped model's."""
        self._refuse("register_module", name)
