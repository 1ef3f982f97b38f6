"""Distributed hook surgery: FlexModel over tensor, data and pipeline parallel ranks.

Built on ``torch.distributed`` (gloo on CPUs, NCCL on GPUs), ``DeviceMesh`` and
``DTensor``. :func:`make_routing` is what :class:`~torchsurgery.FlexModel` calls when it
is given parallel sizes, a process group or a device mesh.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchsurgery.distributed.layout import Layout, make_layout
from torchsurgery.distributed.routing import DistributedRouting

__all__ = ["Layout", "make_layout", "DistributedRouting", "make_routing"]


def make_routing(
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int = 1,
    process_group: dist.ProcessGroup | None = None,
    device_mesh: DeviceMesh | None = None,
) -> DistributedRouting:
    """The routing for this rank of a ``pp x dp x tp`` layout (see :func:`make_layout`)."""
    layout = make_layout(
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        data_parallel_size=data_parallel_size,
        process_group=process_group,
        device_mesh=device_mesh,
    )
    return DistributedRouting(layout)
