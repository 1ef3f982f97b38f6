"""The device bytes of an offload: one account of what its weights take, and the budget checks on it.

Every byte count of a plan comes from here: what a weight holds resident (:func:`held_bytes`),
what a group adds while it streams (:func:`streaming_bytes`), and what an offload holds at once
with some groups resident (:func:`device_bytes`), each allocation rounded up as the device
rounds it. :func:`check_budget` refuses a budget below the least the offload runs in, naming
what that least holds; :func:`least_refused` words the refusal of the finest plan there is.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from torch import nn

from torchsurgery._device import OffloadDevice
from torchsurgery._tensor_layout import ALIGNMENT, align
from torchsurgery.compact import dequantize_temporary_bytes
from torchsurgery.errors import BudgetError
from torchsurgery.offloading.plan_types import GroupPlan, ParamPlan, PlanOptions, Residency

__all__ = ["held_bytes", "held_by", "buffer_bytes", "streaming_bytes", "device_bytes", "check_budget", "least_refused"]

_WHAT = "torchsurgery.offload"


def held_bytes(p: ParamPlan, granule: int = 1) -> int:
    """Device bytes ``p`` takes resident: its values in its storage dtype, and a master's narrow copy
    or a scaled weight's scale besides.

    Each is one allocation, rounded up to ``granule`` bytes (the device's allocation granule).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> plan = torchsurgery.plan_offload(nn.Linear(4, 4, bias=False), storage_dtype=torch.bfloat16,
        ...                                  master_dtype=torch.float32, dtype=torch.float32)
        >>> held_bytes(plan.params[0])  # 16 fp32 master values and their 16 bf16 copies
        96
        >>> from torchsurgery.compact import Scaled
        >>> plan = torchsurgery.plan_offload(nn.Linear(4, 4, bias=False), storage_dtype=Scaled(torch.int8), dtype=torch.float32)
        >>> held_bytes(plan.params[0])  # 16 int8 values and 4 fp32 scales
        32
    """
    numel = p.nbytes // p.compute_dtype.itemsize
    shadow = _allocated(numel * p.shadow_dtype.itemsize, granule) if p.shadow_dtype is not None else 0
    scale = _allocated(p.scale_nbytes, granule) if p.scale_nbytes else 0
    return _allocated(numel * p.storage_dtype.itemsize, granule) + shadow + scale


def held_by(group: GroupPlan, granule: int) -> int:
    """Device bytes ``group`` takes resident (:func:`held_bytes` of its parameters, tied ones once)."""
    return sum(held_bytes(p, granule) for p in group.params if p.tied_to is None)


def _allocated(nbytes: int, granule: int) -> int:
    """What an allocation of ``nbytes`` takes on a device that rounds allocations up to ``granule`` bytes."""
    return -(-nbytes // granule) * granule


def buffer_bytes(model: nn.Module, seam: OffloadDevice) -> int:
    """Device bytes of the model's buffers, which the offload moves to the device (none on a CPU)."""
    if seam.host_compute:
        return 0
    unique = {id(b): b for b in model.buffers()}
    return sum(_allocated(b.nbytes, seam.allocation_granule) for b in unique.values())


def _widened_bytes(p: ParamPlan) -> int:
    """What a read of ``p`` widens it to for a product (its compute dtype, through fp32 for a scaled
    weight: :func:`_through_fp32`), where it is held in another dtype."""
    widened = p.tied_to is None and (p.storage_dtype != p.compute_dtype or p.shadow_dtype is not None)
    return p.nbytes + _through_fp32(p) if widened else 0


def _through_fp32(p: ParamPlan) -> int:
    """What a scaled weight's dequantisation holds besides its result, for as long as the cast
    takes (:func:`~torchsurgery.compact.dequantize_temporary_bytes`)."""
    if p.scaled is None:
        return 0
    return dequantize_temporary_bytes(p.nbytes // p.compute_dtype.itemsize, p.compute_dtype)


def streaming_bytes(group: GroupPlan, granule: int = 1) -> tuple[int, int]:
    """Device bytes ``group`` takes while it streams, besides what it takes when resident.

    Every allocation is rounded up to ``granule`` bytes (the device's allocation granule).

    Returns:
        (its ring slot: the weights the ring carries, in their storage dtype, each aligned
        as the ring packs them, and the scales of scaled weights after them; what a run adds:
        casts to the compute dtype (through a master's narrow dtype, or a scaled weight's
        fp32 dequantisation, whose copy lives next to the cast while it is made), the
        weights converted at each run, such as a tied weight another group holds, and the
        widest of the weights read narrow in place, widened for a product).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> plan = torchsurgery.plan_offload(nn.Conv1d(4, 4, 1), storage_dtype=torch.bfloat16, dtype=torch.float32)
        >>> streaming_bytes(plan.groups[0])  # weight at 0, bias at 256 (bf16); both cast to fp32 per run
        (264, 80)
    """
    ring = sorted(  # the order the engine packs them in
        (p for p in group.params if p.residency in (Residency.STREAMED, Residency.FILE)), key=lambda p: str(p.storage_dtype)
    )
    end = per_run = through = 0
    for p in ring:
        end = align(end, ALIGNMENT) + p.nbytes // p.compute_dtype.itemsize * p.storage_dtype.itemsize
        if p.storage_dtype != p.compute_dtype or p.shadow_dtype is not None:  # cast (a master: through its copy's dtype)
            per_run += _allocated(p.nbytes, granule)
        through = max(through, _allocated(_through_fp32(p), granule))
    for p in ring:
        if p.scale_nbytes:  # the scales, after every weight's values
            end = align(end, ALIGNMENT) + p.scale_nbytes
    converted = [p for p in group.params if p.residency is Residency.CONVERTED]
    per_run += sum(_allocated(p.nbytes, granule) for p in converted)
    for p in ring + converted:
        if p.shadow_dtype is not None:
            through = max(through, _allocated(p.nbytes // p.compute_dtype.itemsize * p.shadow_dtype.itemsize, granule))
    in_place = (p for p in group.params if p.residency in (Residency.NARROW, Residency.RESIDENT))
    widened = max((_allocated(_widened_bytes(p), granule) for p in in_place), default=0)
    return _allocated(end, granule) if end else 0, per_run + through + widened


def device_bytes(
    groups: Sequence[GroupPlan], resident: Collection[str], prefetch: int, granule: int = 1, buffers: int = 0
) -> int:
    """Device bytes an offload holds at once with the groups named in ``resident`` kept resident.

    The one account of a budget, used to check it, to keep groups resident from the start
    and to choose more after the first forward: the buffers (``buffers`` bytes), the
    resident groups' weights as held, the ring's ``prefetch + 1`` slots, each sized for the
    largest group that still streams, what the largest run adds to them (casts, converted
    weights) and the widest read of a resident weight held in another dtype. Every
    allocation is rounded up to ``granule`` bytes. The groups outside ``resident`` are taken
    as they are routed to stream (see :func:`streaming_bytes`). Forwards that record
    gradients do not use the ring: autograd keeps their groups' weights until backward.

    Example:
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> plan = torchsurgery.plan_offload(model, "cpu", groups="leaves")
        >>> device_bytes(plan.groups, {"0", "1"}, prefetch=1)  # both resident: 2 x (64 + 16)
        160
    """
    kept = [g for g in groups if g.name in resident]
    streamed = [streaming_bytes(g, granule) for g in groups if g.name not in resident]
    slot = max((s for s, _ in streamed), default=0)
    held = sum(held_by(g, granule) for g in kept)
    widened = max((_allocated(_widened_bytes(p), granule) for g in kept for p in g.params), default=0)
    return buffers + held + (prefetch + 1) * slot + max((r for _, r in streamed), default=0) + widened


def check_budget(budget: int, groups: list[GroupPlan], options: PlanOptions, buffers: int) -> None:
    """Refuse a budget below what the offload needs at the least: the model kept whole, or else
    its largest group resident and the ring at its prefetch with every group streamed."""
    granule = options.device.allocation_granule
    whole = device_bytes(groups, {g.name for g in groups}, options.prefetch, granule, buffers)
    if budget >= whole:
        return
    big = max(groups, key=lambda g: held_by(g, granule))
    largest = held_by(big, granule)
    streaming = device_bytes(groups, set(), options.prefetch, granule, buffers)
    needed = min(whole, max(largest, streaming))
    if budget >= needed:
        return
    holding = None
    ring = (
        f"what streaming holds on the device at once with prefetch={options.prefetch}: "
        f"{options.prefetch + 1} ring slots sized for the largest streamed group, a run's casts"
        + (" and the model's buffers" if buffers else "")
    )
    if needed == whole:
        holding = f"the model whole ({needed} bytes), less than {ring} ({streaming} bytes)"
    elif needed > largest:
        holding = f"{ring} ({needed} bytes)"
    raise BudgetError(_WHAT, budget, needed, big.name, finer=options.finer_groups, holding=holding)


def least_refused(groups: list[GroupPlan], error: BudgetError, options: PlanOptions, buffers: int) -> BudgetError:
    """The refusal of a budget below the least the model runs in: streamed one module at a time."""
    granule = options.device.allocation_granule
    weight = max((p for g in groups for p in g.params if p.tied_to is None), key=lambda p: held_bytes(p, granule))
    holding = (
        f"the model streamed one module at a time (groups='leaves', prefetch=0), the least it runs in: its largest "
        f"single weight {weight.name!r} ({held_bytes(weight, granule)} bytes) in one ring slot, with a run's casts"
        + (" and the model's buffers" if buffers else "") + f" ({error.needed} bytes)"
    )
    return BudgetError(_WHAT, error.budget, error.needed, weight.module, finer=False, holding=holding)
