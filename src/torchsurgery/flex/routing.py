"""Where activations travel between the model and a hook's editing function.

A hook sees one rank's *local* activation. Its editing function must see the *full*
tensor (a tensor-parallel shard gathered, a data-parallel batch assembled), and the
model must get back a local tensor again. A :class:`Routing` does both moves and says
whether this process writes captures to ``output_ptr``. In one process nothing moves:
:class:`LocalRouting`. The distributed routings live in :mod:`torchsurgery.distributed`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Routing(Protocol):
    """How a :class:`~torchsurgery.FlexModel` moves activations for its hooks."""

    def gather(self, local: torch.Tensor, hook: Any) -> torch.Tensor:
        """The full tensor the editing function sees, from this rank's ``local`` one.

        ``hook`` is the :class:`~torchsurgery.HookFunction` (for ``expected_shape``).
        """
        ...

    def scatter(self, full: torch.Tensor, local: torch.Tensor, hook: Any) -> torch.Tensor:
        """This rank's part of the edited ``full`` tensor, shaped like ``local``."""
        ...

    def saves_outputs(self) -> bool:
        """Whether this process appends captures to ``output_ptr``."""
        ...

    def end_forward(self, output_ptr: dict[str, list[torch.Tensor]]) -> None:
        """Called after every forward (e.g. pipeline stages ship captures to rank 0)."""
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
        >>> import torch
        >>> routing = LocalRouting()
        >>> t = torch.ones(2)
        >>> routing.scatter(t, t, None) is t, routing.saves_outputs()
        (True, True)
    """

    def gather(self, local: torch.Tensor, hook: Any) -> torch.Tensor:
        check_expected_shape(local, hook)
        return local

    def scatter(self, full: torch.Tensor, local: torch.Tensor, hook: Any) -> torch.Tensor:
        return full

    def saves_outputs(self) -> bool:
        return True

    def end_forward(self, output_ptr: dict[str, list[torch.Tensor]]) -> None:
        return None
