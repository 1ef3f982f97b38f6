"""Where activations travel between the model and a hook's editing function.

A hook sees one rank's *local* activation. Its editing function must see the *full*
tensor (a tensor-parallel shard gathered, a data-parallel batch assembled), and the
model must get back a local tensor again; captures must reach the process that holds
``output_ptr``. A :class:`Routing` does all of it, and runs the model (pipeline stages
pass activations on). In one process nothing moves: :class:`LocalRouting`.

For a wrapper given parallel sizes, a process group or a device mesh, :func:`routing_for`
builds flex's own routing over ``torch.distributed`` ranks
(:class:`~torchsurgery.flex.parallel.routing.DistributedRouting`, imported then: it is slow
to import), or the one a factory registered with :func:`register_parallel_routing` builds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from torchsurgery.flex.captures import Captures
from torchsurgery.flex.hook_function import Binding, Edit, HookType, Shape
from torchsurgery.flex.parallel.request import ParallelRequest, ParallelSizes
from torchsurgery.flex.shape_hints import HintCheck

__all__ = [
    "Edit",
    "Routing",
    "RoutingFactory",
    "LocalRouting",
    "register_parallel_routing",
    "routing_for",
]


class Routing(Protocol):
    """How a :class:`~torchsurgery.FlexModel` moves activations for its hooks."""

    @property
    def sizes(self) -> ParallelSizes:
        """The parallel sizes this routing spans (a device mesh gives its own)."""
        ...

    def route(
        self, binding: Binding, module: nn.Module | None, local: torch.Tensor, edit: Edit | None, captures: Captures
    ) -> torch.Tensor | None:
        """Capture ``local`` (as the full tensor) into ``captures`` and, when ``edit`` is
        given, return the local part of the edited full tensor."""
        ...

    def forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run this process's part of the model."""
        ...

    def end_forward(self, captures: Captures, *, failed: bool = False) -> None:
        """Called once after every forward, also a failed one (``failed=True``)."""
        ...

    def backward(self, captures: Captures, loss: torch.Tensor | None) -> None:
        """Run the backward of ``loss`` (``None`` on processes that hold no loss)."""
        ...

    def matched_anywhere(self, found: bool, hook_type: HookType, name: str) -> bool:
        """Whether a hook's target exists in some process (pipeline stages hold parts)."""
        ...

    def gather_parameter(self, local: torch.Tensor, name: str, expected_shape: Shape | None) -> torch.Tensor:
        """The full parameter ``name`` from this process's ``local`` part."""
        ...

    def prepare_trainable(self, module: nn.Module) -> None:
        """Called when a trainable module is registered."""
        ...

    def close(self) -> None:
        """Called when the wrapper is restored."""
        ...


RoutingFactory = Callable[[ParallelRequest], Routing]
"""Builds the routing for a wrapper that asked for parallel ranks."""

_PARALLEL: list[RoutingFactory] = []


def register_parallel_routing(factory: RoutingFactory | None) -> RoutingFactory | None:
    """Make ``factory`` build the routing of every wrapper given parallel arguments.

    Without one, such a wrapper gets flex's own
    :class:`~torchsurgery.flex.parallel.routing.DistributedRouting`; ``None`` puts that back.

    Returns:
        The factory registered before (``None`` if there was none), to put back later.

    Raises:
        TypeError: ``factory`` is neither callable nor ``None``.

    Example:
        >>> previous = register_parallel_routing(lambda request: LocalRouting())
        >>> routing_for(ParallelRequest.of(tensor_parallel_size=2)).sizes
        ParallelSizes(tensor=1, pipeline=1, data=1)
        >>> _ = register_parallel_routing(previous)
    """
    if factory is not None and not callable(factory):
        raise TypeError(
            f"torchsurgery.flex.register_parallel_routing: expected a callable taking a ParallelRequest "
            f"and returning a Routing (or None for flex's own routing), got {factory!r}"
        )
    previous = _PARALLEL[0] if _PARALLEL else None
    _PARALLEL[:] = [] if factory is None else [factory]
    return previous


def routing_for(request: ParallelRequest, what: str = "torchsurgery.FlexModel") -> Routing:
    """:class:`LocalRouting` for a request in one process, else the registered factory's
    routing, else flex's own routing over ``torch.distributed`` ranks.

    Raises:
        RuntimeError: parallel arguments, but torch was built without distributed support.

    Example:
        >>> type(routing_for(ParallelRequest.of())).__name__
        'LocalRouting'
    """
    if request.is_local:
        return LocalRouting()
    if not torch.distributed.is_available():
        raise RuntimeError(
            f"{what}: {request.sizes} with process_group={request.process_group!r} need torch.distributed, "
            "which this build of torch does not include; run in one process (all sizes 1)"
        )
    if _PARALLEL:
        return _PARALLEL[0](request)
    # imported by the first parallel wrapper: torch.distributed.tensor is slow to import
    from torchsurgery.flex.parallel.routing import distributed_routing

    return distributed_routing(request)


class LocalRouting:
    """Everything in one process: the local tensor is the full tensor.

    Nothing is sharded, so no ``expected_shape`` is needed: a hint that does not match is
    told once per hook as a :class:`~torchsurgery.flex.shape_hints.ShapeHintWarning`.

    Example:
        >>> from torchsurgery.flex.hook_function import HookFunction
        >>> out = {}
        >>> binding = Binding(HookFunction("fc"), "forward", "fc", "fc")
        >>> LocalRouting().route(binding, None, torch.ones(2), lambda t: t * 2, Captures(out)).tolist()
        [2.0, 2.0]
        >>> out["fc"][0].tolist()
        [1.0, 1.0]
    """

    sizes = ParallelSizes()

    def __init__(self) -> None:
        self.hints = HintCheck()

    def route(
        self, binding: Binding, module: nn.Module | None, local: torch.Tensor, edit: Edit | None, captures: Captures
    ) -> torch.Tensor | None:
        self.hints.check(local, binding.hook.expected_shape, binding.key, why="one process")
        captures.capture(binding.key, local)
        return edit(local) if edit is not None else None

    def forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return module(*args, **kwargs)

    def end_forward(self, captures: Captures, *, failed: bool = False) -> None:
        return None

    def backward(self, captures: Captures, loss: torch.Tensor | None) -> None:
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"torchsurgery.FlexModel.backward: expected the loss tensor, got {type(loss).__name__}")
        loss.backward()

    def matched_anywhere(self, found: bool, hook_type: HookType, name: str) -> bool:
        return found

    def gather_parameter(self, local: torch.Tensor, name: str, expected_shape: Shape | None) -> torch.Tensor:
        self.hints.check(local, expected_shape, name, why="one process")
        return local

    def prepare_trainable(self, module: nn.Module) -> None:
        return None

    def close(self) -> None:
        return None
