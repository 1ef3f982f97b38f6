"""Hook surgery: capture and edit what flows through a model (flex_model compatible).

flex owns the hook runtime. A routing over ``torch.distributed`` ranks plugs in through
:func:`register_parallel_routing`; flex itself imports nothing of it.
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
