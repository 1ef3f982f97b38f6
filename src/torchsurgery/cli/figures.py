"""Where a model's weights are, in words that mean the same on every device.

All figures are bytes of weights (parameters):

* held: what the weights take in memory as stored (host memory or an accelerator's);
  weights left in a checkpoint file take none;
* resident: ready where the computation runs, in the compute dtype, for every forward;
* streamed: everything else (in host memory for an accelerator, in a compact storage
  dtype, or in the file), brought in group by group when the group runs;
* moved: what was actually brought in: copied to an accelerator, cast to the compute
  dtype, or read from the file;
* peak: the most bytes ready at once: resident plus what was brought in at the same time
  (on an accelerator, also the weights the engine keeps there in a storage dtype, which it
  widens when they are used).

Resident and streamed are read from the parameters themselves, not from the offload
engine's group labels: on a CPU, a group the engine streams whose weights already sit in
host memory in the compute dtype moves nothing, and is counted resident.
"""

from __future__ import annotations

import torch
from torch import nn

import torchsurgery
from torchsurgery.offloading import stored_values


def _ready(p: torch.Tensor, device: torch.device, compute: torch.dtype) -> bool:
    p = stored_values(p)  # an offloaded weight reads as its compute dtype; what counts is how it is kept
    if p.is_meta or p.device.type != device.type:
        return False
    if device.index is not None and p.device.index != device.index:
        return False
    return p.dtype == compute or not p.is_floating_point()


def figures(
    model: nn.Module,
    device: torch.device,
    compute: torch.dtype,
    stats: torchsurgery.OffloadStats | None = None,
    moved: int = 0,
) -> dict[str, int]:
    """``held``, ``resident``, ``streamed``, ``moved`` and ``peak`` bytes of ``model``'s weights.

    Args:
        model: the model, offloaded or not.
        device: where it computes.
        compute: the compute dtype of its floating weights.
        stats: the offload engine's statistics, when it is offloaded.
        moved: bytes brought in (from ``stats``, over the forwards of interest).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> figures(nn.Linear(4, 4), torch.device("cpu"), torch.float32)
        {'held_bytes': 80, 'resident_bytes': 80, 'streamed_bytes': 0, 'moved_bytes': 0, 'peak_bytes': 80}
    """
    held = resident = streamed = kept = 0
    for p in model.parameters():
        size = stored_values(p).nbytes
        held += 0 if p.is_meta else size
        if _ready(p, device, compute):
            resident += size
        else:
            streamed += size
            kept += size if device.type != "cpu" and _ready(p, device, stored_values(p).dtype) else 0
    # the engine's peak counts its own resident groups plus what it brought in at once
    in_flight = stats.peak_device_bytes - stats.resident_bytes if stats is not None else 0
    return {"held_bytes": held, "resident_bytes": resident, "streamed_bytes": streamed, "moved_bytes": moved,
            "peak_bytes": resident + kept + max(0, in_flight)}
