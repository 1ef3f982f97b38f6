"""Distributed hook surgery: FlexModel over tensor, data and pipeline parallel ranks.

Built on ``torch.distributed`` (gloo on CPUs, NCCL on GPUs), ``DeviceMesh`` and
``DTensor``. ``torchsurgery`` registers :func:`distributed_routing` with
:func:`torchsurgery.flex.register_parallel_routing`, so a
:class:`~torchsurgery.FlexModel` given parallel sizes, a process group or a device mesh
builds a :class:`Layout` and routes its hooks through a :class:`DistributedRouting`.
"""

from torchsurgery.distributed.layout import Layout, make_layout
from torchsurgery.distributed.routing import DistributedRouting, distributed_routing

__all__ = ["Layout", "make_layout", "DistributedRouting", "distributed_routing"]
