"""Hook surgery: capture and edit what flows through a model (flex_model compatible)."""

from torchsurgery.flex.dummy import DummyModule
from torchsurgery.flex.hook_function import HookFunction, default_editing_function
from torchsurgery.flex.model import FlexModel
from torchsurgery.flex.routing import LocalRouting, Routing

__all__ = ["FlexModel", "HookFunction", "DummyModule", "default_editing_function", "Routing", "LocalRouting"]
