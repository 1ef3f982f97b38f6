"""Where each rank sits in a ``pp x dp x tp`` layout, and the process groups of each axis.

Ranks are laid out as Megatron-LM and flex_model do: tensor-parallel ranks are
contiguous, data-parallel next, pipeline stages outermost, so the rank at position
``i`` of the layout's group has ``tp = i % tp_size``, ``dp = (i // tp_size) % dp_size``
and ``pp = i // (tp_size * dp_size)``. A layout is built from the flex_model sizes, from
a :class:`~torch.distributed.device_mesh.DeviceMesh` with named dimensions, and may be
restricted to one process group. It never creates the default process group when one
exists; with none, it starts one only from torchrun's environment variables.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Layout", "make_layout"]

AXES = ("pp", "dp", "tp")
_WHAT = "torchsurgery.FlexModel"
# Layouts already built, so wrapping models again (a notebook habit) creates no new groups.
# Keyed by the parent group object itself: a re-initialised world is a new object.
_BUILT: dict[tuple[object, ...], Layout] = {}


@dataclass(frozen=True)
class Layout:
    """This rank's coordinates and the groups of a ``pp x dp x tp`` layout.

    Attributes:
        tp_size, dp_size, pp_size: the sizes of the three axes.
        tp_rank, dp_rank, pp_rank: this rank's coordinates.
        ranks: the global ranks of the layout, in layout order (position 0 alone receives
            the captures with ``captures_on="first_rank"``).
        group: the whole layout's process group.
        tp_group, dp_group, pp_group: this rank's groups along each axis.
        stage_group: the ``dp x tp`` ranks of this rank's pipeline stage.
        device: where collectives take their tensors (``cpu`` for gloo, the current CUDA
            device for NCCL).

    Example:
        >>> layout_position(5, tp_size=2, dp_size=2)  # (pp, dp, tp) of position 5
        (1, 0, 1)
    """

    tp_size: int
    dp_size: int
    pp_size: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    ranks: tuple[int, ...]
    group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    stage_group: dist.ProcessGroup
    device: torch.device

    @property
    def position(self) -> int:
        """This rank's position in :attr:`ranks`."""
        return position_of(self.pp_rank, self.dp_rank, self.tp_rank, tp_size=self.tp_size, dp_size=self.dp_size)

    @property
    def is_root(self) -> bool:
        """Whether this rank is position 0 of the layout (the receiver with ``captures_on="first_rank"``)."""
        return self.position == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def global_rank(self, *, pp: int, dp: int, tp: int) -> int:
        """The global rank at the given coordinates."""
        return self.ranks[position_of(pp, dp, tp, tp_size=self.tp_size, dp_size=self.dp_size)]


def position_of(pp: int, dp: int, tp: int, *, tp_size: int, dp_size: int) -> int:
    """The position in layout order of the coordinates ``(pp, dp, tp)``."""
    return (pp * dp_size + dp) * tp_size + tp


def layout_position(position: int, *, tp_size: int, dp_size: int) -> tuple[int, int, int]:
    """``(pp, dp, tp)`` coordinates of a position in layout order."""
    return position // (tp_size * dp_size), (position // tp_size) % dp_size, position % tp_size


def _ensure_initialized() -> None:
    if dist.is_initialized():
        return
    if all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        # launched by torchrun but not initialised yet: the one case where we start it
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        return
    raise RuntimeError(
        f"{_WHAT}: parallel sizes above 1 need torch.distributed; call "
        "torch.distributed.init_process_group(...) first, or launch with torchrun"
    )


def _device_for(group: dist.ProcessGroup) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _subgroup(ranks: Sequence[int], cache: dict[tuple[int, ...], dist.ProcessGroup]) -> dist.ProcessGroup:
    key = tuple(ranks)
    if key not in cache:
        # only the members take part, so each rank builds just the groups it is in
        cache[key] = _new_group(key)
    return cache[key]


def _new_group(ranks: Sequence[int]) -> dist.ProcessGroup:
    """A process group of ``ranks``, built by its members alone (this rank among them)."""
    group = dist.new_group(list(ranks), use_local_synchronization=True)
    # torch types the result as a group or "not a member" (a constant): a member always gets the group
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"{_WHAT}: rank {dist.get_rank()} got no process group for ranks {list(ranks)}")
    return group


def _from_ranks(
    ranks: tuple[int, ...], group: dist.ProcessGroup, tp_size: int, dp_size: int, pp_size: int
) -> Layout:
    key = (group, ranks, tp_size, dp_size, pp_size)
    if key not in _BUILT:
        _BUILT[key] = _build(ranks, group, tp_size, dp_size, pp_size)
    return _BUILT[key]


def _build(ranks: tuple[int, ...], group: dist.ProcessGroup, tp_size: int, dp_size: int, pp_size: int) -> Layout:
    me = dist.get_rank()
    position = ranks.index(me)
    pp, dp, tp = layout_position(position, tp_size=tp_size, dp_size=dp_size)
    cache: dict[tuple[int, ...], dist.ProcessGroup] = {ranks: group}

    def at(p: int, d: int, t: int) -> int:
        return ranks[position_of(p, d, t, tp_size=tp_size, dp_size=dp_size)]

    return Layout(
        tp_size=tp_size, dp_size=dp_size, pp_size=pp_size, tp_rank=tp, dp_rank=dp, pp_rank=pp,
        ranks=ranks, group=group,
        tp_group=_subgroup([at(pp, dp, t) for t in range(tp_size)], cache),
        dp_group=_subgroup([at(pp, d, tp) for d in range(dp_size)], cache),
        pp_group=_subgroup([at(p, dp, tp) for p in range(pp_size)], cache),
        stage_group=_subgroup([at(pp, d, t) for d in range(dp_size) for t in range(tp_size)], cache),
        device=_device_for(group),
    )


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    if world is None:  # _ensure_initialized() ran first; this is for the type checker
        raise RuntimeError(f"{_WHAT}: torch.distributed has no default process group")
    return world


def _mesh_ranks(
    device_mesh: DeviceMesh, sizes: dict[str, int], process_group: dist.ProcessGroup | None
) -> tuple[tuple[int, ...], dist.ProcessGroup]:
    """The mesh's ranks in ``pp, dp, tp`` order and the group they form; ``sizes`` updated
    from the mesh's dimensions (a size given above 1 must agree)."""
    names = device_mesh.mesh_dim_names
    if not names or any(n not in AXES for n in names):
        raise ValueError(
            f"{_WHAT}: device_mesh dimensions must be named among {AXES}, got {names!r}; "
            "build it with init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
        )
    for name in names:
        size = device_mesh.size(names.index(name))
        if sizes[name] not in (1, size):
            raise ValueError(
                f"{_WHAT}: {name} size {sizes[name]} disagrees with the device mesh's {name} "
                f"dimension of size {size}; pass the mesh alone"
            )
        sizes[name] = size
    # put the mesh in pp, dp, tp order; missing axes have size 1
    order = [n for n in AXES if n in names]
    mesh = device_mesh.mesh.permute([names.index(n) for n in order])
    ranks = tuple(int(r) for r in mesh.flatten().tolist())
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"{_WHAT}: rank {me} is not in the device mesh {ranks}")
    if process_group is not None:
        return ranks, process_group
    if len(ranks) == dist.get_world_size():
        return ranks, _world()
    return ranks, _new_group(ranks)


def make_layout(
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int = 1,
    process_group: dist.ProcessGroup | None = None,
    device_mesh: DeviceMesh | None = None,
) -> Layout:
    """Build the layout of this rank, from sizes (Megatron order) or a device mesh.

    Every rank of the layout must call this, in the same order as its other collective
    calls (it creates the per-axis groups).

    Args:
        tensor_parallel_size: ranks per tensor-parallel group (contiguous ranks).
        pipeline_parallel_size: number of pipeline stages.
        data_parallel_size: number of data-parallel replicas.
        process_group: lay out only this group's ranks (default: the whole world).
        device_mesh: a mesh whose dimension names are among ``pp``, ``dp``, ``tp``;
            the sizes are read from it and must agree with any size given above 1.

    Returns:
        This rank's :class:`Layout`.

    Raises:
        ValueError: the sizes do not multiply to the group's size (the numbers are
            named), a mesh dimension has another name, or this rank is not in the group.
        RuntimeError: no process group exists and this is not a torchrun launch.
    """
    _ensure_initialized()
    sizes = {"tp": tensor_parallel_size, "dp": data_parallel_size, "pp": pipeline_parallel_size}
    if device_mesh is not None:
        ranks, group = _mesh_ranks(device_mesh, sizes, process_group)
    else:
        group = process_group or _world()
        ranks = tuple(dist.get_process_group_ranks(group))
        if dist.get_rank() not in ranks:
            raise ValueError(f"{_WHAT}: rank {dist.get_rank()} is not in process_group (ranks {list(ranks)})")
    wanted = sizes["tp"] * sizes["dp"] * sizes["pp"]
    if wanted != len(ranks):
        raise ValueError(
            f"{_WHAT}: tensor_parallel_size {sizes['tp']} x pipeline_parallel_size {sizes['pp']} x "
            f"data_parallel_size {sizes['dp']} = {wanted}, but the process group has {len(ranks)} "
            f"rank(s); choose sizes whose product is {len(ranks)}"
        )
    return _from_ranks(ranks, group, sizes["tp"], sizes["dp"], sizes["pp"])
