"""flex's parallel backend: FlexModel over tensor, data and pipeline parallel ranks.

Built on ``torch.distributed`` (gloo on CPUs, NCCL on GPUs), ``DeviceMesh`` and
``DTensor``. A :class:`~torchsurgery.FlexModel` given parallel sizes, a process group or a
device mesh asks :func:`torchsurgery.flex.routing.routing_for` for its routing, which builds
a :class:`Layout` and a :class:`DistributedRouting` (unless a factory was registered with
:func:`torchsurgery.flex.register_parallel_routing`).

The request types (:class:`ParallelRequest`, :class:`ParallelSizes`) are imported with
the package. The backend (:class:`Layout`, :func:`make_layout`, :class:`DistributedRouting`,
:func:`distributed_routing`) is imported on first use: ``torch.distributed.tensor`` is slow
to import, and a wrapper in one process never needs it.

Example:
    >>> from torchsurgery.flex.parallel import ParallelRequest
    >>> ParallelRequest.of(tensor_parallel_size=2).sizes.world
    2
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torchsurgery.flex.parallel.request import (
    CAPTURES_ON,
    CapturesOn,
    ParallelRequest,
    ParallelSizes,
)

if TYPE_CHECKING:
    from torchsurgery.flex.parallel.layout import Layout, make_layout
    from torchsurgery.flex.parallel.routing import DistributedRouting, distributed_routing

__all__ = [
    # what a wrapper asks for (imported with the package)
    "ParallelRequest",
    "ParallelSizes",
    "CapturesOn",
    "CAPTURES_ON",
    # the backend (imported on first use)
    "Layout",
    "make_layout",
    "DistributedRouting",
    "distributed_routing",
]

# the backend's public names and the module of each, imported when first asked for
_BACKEND = {
    "Layout": "layout",
    "make_layout": "layout",
    "DistributedRouting": "routing",
    "distributed_routing": "routing",
}


def __getattr__(name: str) -> Any:
    module = _BACKEND.get(name)
    if module is None:
        raise AttributeError(f"module 'torchsurgery.flex.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(f"torchsurgery.flex.parallel.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_BACKEND))
