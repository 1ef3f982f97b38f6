"""What a :class:`~torchsurgery.FlexModel` asks of the ranks it runs on.

flex_model's constructor takes three parallel sizes and a process group; a device mesh
may stand for all of them. :class:`ParallelRequest` holds them, checked, with the ranks
that receive the captures, and says whether the wrapper runs in one process
(:attr:`ParallelRequest.is_local`) or needs a routing over ``torch.distributed`` ranks.
:class:`ParallelSizes` are the sizes the routing settled on (a device mesh gives its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelSizes", "ParallelRequest", "CapturesOn", "CAPTURES_ON"]

CapturesOn = Literal["every_rank", "first_rank"]
"""Which ranks' ``output_ptr`` receives the captures: all of them (flex_model's choice), or
only the layout's first rank (less memory and traffic)."""

CAPTURES_ON: tuple[CapturesOn, ...] = ("every_rank", "first_rank")


@dataclass(frozen=True)
class ParallelSizes:
    """Ranks per tensor-parallel group, pipeline stages and data-parallel replicas.

    Example:
        >>> ParallelSizes(tensor=2, data=2).world
        4
    """

    tensor: int = 1
    pipeline: int = 1
    data: int = 1

    @property
    def world(self) -> int:
        """How many ranks the layout holds."""
        return self.tensor * self.pipeline * self.data


@dataclass(frozen=True)
class ParallelRequest:
    """The parallel arguments of a ``FlexModel``, checked.

    Attributes:
        sizes: the sizes asked for (all 1 unless given).
        process_group: lay out only this group's ranks (``None``: the whole world).
        device_mesh: a ``DeviceMesh`` whose named dimensions give the sizes and rank order.
        captures_on: which ranks receive the captures (``"every_rank"`` unless given).

    Example:
        >>> ParallelRequest.of(tensor_parallel_size=2).is_local
        False
        >>> ParallelRequest.of().is_local
        True
    """

    sizes: ParallelSizes
    process_group: ProcessGroup | None = None
    device_mesh: DeviceMesh | None = None
    captures_on: CapturesOn = "every_rank"

    @classmethod
    def of(
        cls,
        *,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        process_group: ProcessGroup | None = None,
        device_mesh: DeviceMesh | None = None,
        captures_on: CapturesOn = "every_rank",
        what: str = "torchsurgery.FlexModel",
    ) -> ParallelRequest:
        """Check flex_model's arguments (and ``captures_on``) and hold them.

        Raises:
            ValueError: a size is not a positive int, or ``captures_on`` is not one of
                :data:`CAPTURES_ON` (the name and value are given).
        """
        given = {
            "tensor_parallel_size": tensor_parallel_size,
            "pipeline_parallel_size": pipeline_parallel_size,
            "data_parallel_size": data_parallel_size,
        }
        for key, value in given.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{what}: {key} must be a positive int, got {value!r}")
        if captures_on not in CAPTURES_ON:
            raise ValueError(
                f"{what}: captures_on must be one of {CAPTURES_ON} (every rank's output_ptr, or the "
                f"first rank's alone), got {captures_on!r}"
            )
        sizes = ParallelSizes(tensor=tensor_parallel_size, pipeline=pipeline_parallel_size, data=data_parallel_size)
        return cls(sizes, process_group, device_mesh, captures_on)

    @property
    def is_local(self) -> bool:
        """Whether everything runs in this process (no group, no mesh, every size 1)."""
        return self.process_group is None and self.device_mesh is None and self.sizes.world == 1
