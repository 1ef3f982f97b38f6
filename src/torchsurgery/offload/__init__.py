"""Where and in what dtype weights live: dynamic swapping and the offload engine."""

from torchsurgery.offload.device import OffloadDevice
from torchsurgery.offload.dynamic_swap import DynamicSwapInstaller
from torchsurgery.offload.engine import DEFAULT_SKIP, OffloadHandle, OffloadStats, offload
from torchsurgery.offload.pool import DevicePool, PoolStats

__all__ = [
    "DynamicSwapInstaller",
    "offload",
    "OffloadHandle",
    "OffloadStats",
    "OffloadDevice",
    "DEFAULT_SKIP",
    "DevicePool",
    "PoolStats",
]
