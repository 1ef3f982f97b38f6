"""Hook surgery: capture and edit what flows through a model (flex_model compatible).

flex owns the hook runtime and its parallel backend, :mod:`torchsurgery.flex.parallel`: a
wrapper given parallel sizes, a process group or a device mesh routes its hooks over
``torch.distributed`` ranks, imported when the first such wrapper is built. Another
routing plugs in through :func:`register_parallel_routing`.
"""

from torchsurgery.flex.dummy import DummyModule
from torchsurgery.flex.hook_function import (
    Binding,
    HookFunction,
    HookType,
    default_editing_function,
)
from torchsurgery.flex.model import FlexModel
from torchsurgery.flex.parallel import ParallelRequest, ParallelSizes
from torchsurgery.flex.routing import (
    LocalRouting,
    Routing,
    RoutingFactory,
    register_parallel_routing,
)
from torchsurgery.flex.shape_hints import ShapeHintWarning

__all__ = [
    # the wrapper and what it runs
    "FlexModel",
    "HookFunction",
    "DummyModule",
    "default_editing_function",
    "ShapeHintWarning",
    # the routing extension point
    "Routing",
    "LocalRouting",
    "RoutingFactory",
    "register_parallel_routing",
    "ParallelRequest",
    "ParallelSizes",
    "Binding",
    "HookType",
]
