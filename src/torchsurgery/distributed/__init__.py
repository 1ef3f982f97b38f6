"""Distributed hook surgery: FlexModel over tensor, data and pipeline parallel ranks.

Built on ``torch.distributed`` (gloo on CPUs, NCCL on GPUs), ``DeviceMesh`` and
``DTensor``. :class:`~torchsurgery.FlexModel` builds a :class:`Layout` with
:func:`make_layout` and routes its hooks through a :class:`DistributedRouting` when it is
given parallel sizes, a process group or a device mesh.
"""

from torchsurgery.distributed.layout import Layout, make_layout
from torchsurgery.distributed.routing import DistributedRouting

__all__ = ["Layout", "make_layout", "DistributedRouting"]
