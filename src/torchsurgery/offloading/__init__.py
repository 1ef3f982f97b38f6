"""The offload pillar: where and in what dtype weights live (dynamic swapping, offload plans and the engine, pools).

The package is named ``offloading`` so that ``torchsurgery.offload`` stays the function.
"""

from torchsurgery._device import OffloadDevice
from torchsurgery.compact import OffloadedTensor, stored_values
from torchsurgery.offloading.dynamic_swap import DynamicSwapInstaller
from torchsurgery.offloading.engine import DEFAULT_SKIP, OffloadHandle, OffloadStats, offload
from torchsurgery.offloading.plan import GroupPlan, OffloadPlan, ParamPlan, Residency, plan_offload
from torchsurgery.offloading.pool import DevicePool, PoolStats
from torchsurgery.offloading.pretrained import from_pretrained

__all__ = [
    "DynamicSwapInstaller",
    "offload",
    "plan_offload",
    "from_pretrained",
    "OffloadPlan",
    "GroupPlan",
    "ParamPlan",
    "Residency",
    "OffloadHandle",
    "OffloadStats",
    "OffloadDevice",
    "OffloadedTensor",
    "stored_values",
    "DEFAULT_SKIP",
    "DevicePool",
    "PoolStats",
]
