"""Where activations travel between the model and a hook's editing function.

A hook sees one rank's *local* activation. Its editing function must see the *full*
tensor (a tensor-parallel shard gathered, a data-parallel batch assembled), and the
model must get back a local tensor again; captures must reach the process that holds
``output_ptr``. A :class:`Routing` does all of it, and runs the model (pipeline stages
pass activations on). In one process nothing moves: :class:`LocalRouting`. The
``torch.distributed`` routing lives in :mod:`torchsurgery.distributed`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

Edit = Callable[[torch.Tensor], torch.Tensor]
"""Runs a hook's editing function on the full tensor (and checks what it returns)."""


class Routing(Protocol):
    """How a :class:`~torchsurgery.FlexModel` moves activations for its hooks."""

    def route(
        self, runtime: Any, binding: Any, module: nn.Module | None, local: torch.Tensor, edit: Edit | None
    ) -> torch.Tensor | None:
        """Capture ``local`` (as the full tensor) through ``runtime.capture`` and, when
        ``edit`` is given, return the local part of the edited full tensor."""
        ...

    def forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run this process's part of the model."""
        ...

    def end_forward(self, output_ptr: dict[str, list[torch.Tensor]], *, failed: bool = False) -> None:
        """Called once after every forward, also a failed one (``failed=True``)."""
        ...

    def backward(self, runtime: Any, loss: torch.Tensor | None) -> None:
        """Run the backward of ``loss`` (``None`` on processes that hold no loss)."""
        ...

    def matched_anywhere(self, found: bool, hook_type: str, name: str) -> bool:
        """Whether a hook's target exists in some process (pipeline stages hold parts)."""
        ...

    def gather_parameter(self, local: torch.Tensor, hook: Any) -> torch.Tensor:
        """The full parameter from this process's ``local`` part."""
        ...

    def prepare_trainable(self, module: nn.Module) -> None:
        """Called when a trainable module is registered."""
        ...

    def close(self) -> None:
        """Called when the wrapper is restored."""
        ...


def check_expected_shape(tensor: torch.Tensor, hook: Any) -> None:
    """Compare ``tensor`` with ``hook.expected_shape`` (``None`` entries match anything)."""
    expected = hook.expected_shape
    if expected is None:
        return
    actual = tuple(tensor.shape)
    if len(expected) != len(actual) or any(e is not None and e != a for e, a in zip(expected, actual, strict=False)):
        raise ValueError(
            f"torchsurgery.HookFunction: the activation of {hook.module_name!r} has shape "
            f"{list(actual)}, but expected_shape is {list(expected)}; fix expected_shape "
            "(None entries match any size)"
        )


class LocalRouting:
    """Everything in one process: the local tensor is the full tensor.

    Example:
        >>> from types import SimpleNamespace
        >>> routing = LocalRouting()
        >>> seen = []
        >>> runtime = SimpleNamespace(capture=lambda key, t: seen.append(key))
        >>> binding = SimpleNamespace(key="fc", hook=SimpleNamespace(expected_shape=None))
        >>> routing.route(runtime, binding, None, torch.ones(2), lambda t: t * 2).tolist(), seen
        ([2.0, 2.0], ['fc'])
    """

    def route(
        self, runtime: Any, binding: Any, module: nn.Module | None, local: torch.Tensor, edit: Edit | None
    ) -> torch.Tensor | None:
        check_expected_shape(local, binding.hook)
        runtime.capture(binding.key, local)
        return edit(local) if edit is not None else None

    def forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return module(*args, **kwargs)

    def end_forward(self, output_ptr: dict[str, list[torch.Tensor]], *, failed: bool = False) -> None:
        return None

    def backward(self, runtime: Any, loss: torch.Tensor | None) -> None:
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"torchsurgery.FlexModel.backward: expected the loss tensor, got {type(loss).__name__}")
        loss.backward()

    def matched_anywhere(self, found: bool, hook_type: str, name: str) -> bool:
        return found

    def gather_parameter(self, local: torch.Tensor, hook: Any) -> torch.Tensor:
        check_expected_shape(local, hook)
        return local

    def prepare_trainable(self, module: nn.Module) -> None:
        return None

    def close(self) -> None:
        return None
