"""What an offloaded model reports: bytes moved, waits, transfer time, peak device bytes, groups."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchsurgery.offloading.residency import GroupCost

SLOW_STORAGE = 100e6
"""Bytes per second below which checkpoint reads are taken as slow: less than a hard disk's sequential read."""
_JUDGED_FROM = 1 << 20  # fewer bytes read say more about system-call overhead than about the disk


def storage_hint(where: str, nbytes: int, seconds: float) -> str:
    """A sentence on checkpoint reads far slower than a local disk's (``""`` where they are not).

    Example:
        >>> storage_hint("model.safetensors", 64 << 20, 4.0)[:71]
        'model.safetensors read at 17 MB/s, far below a local disk (100 MB/s and'
        >>> storage_hint("model.safetensors", 64 << 20, 0.05)
        ''
    """
    if nbytes < _JUDGED_FROM or seconds <= 0 or nbytes / seconds >= SLOW_STORAGE:
        return ""
    return (
        f"{where} read at {nbytes / seconds / 1e6:.0f} MB/s, far below a local disk ({SLOW_STORAGE / 1e6:.0f} MB/s and "
        "up): a slow or network filesystem bounds each forward; copy the folder to a local disk, or give a larger "
        "budget so that fewer groups are read on every forward"
    )


@dataclass
class OffloadStats:
    """What an offloaded model did so far.

    Attributes:
        bytes_moved: bytes brought to the device (or read for a cast) for streamed groups
            and narrow weights, as they are stored (bf16 bytes for bf16 storage).
        transfers: number of group materialisations.
        seconds_waiting: time the computation spent waiting for transfers and casts
            (on a device with streams: between events on its stream, so a prefetched
            group that arrived in time costs nothing).
        seconds_transferring: time the copies and casts of streamed groups took, measured
            between events on the stream they ran on.
        peak_device_bytes: most weight bytes held on the device at once: the resident
            groups, the ring's slots (allocated for as long as groups stream through it) and
            what a running group holds besides (casts to the compute dtype, copies made
            for a forward that records gradients).
        resident_bytes: weight bytes of the resident groups.
        resident_groups: groups kept on the device.
        streamed_groups: groups brought in for each forward.
        hint: whether the last forward was transfer-bound, and what more residency would
            hide (from measured transfer and compute times, in execution order); for a model
            streamed from a checkpoint read far slower than a local disk (:data:`SLOW_STORAGE`),
            a sentence saying so (:func:`storage_hint`).
        prefetch_hits: runs of a group whose weights had been copied in ahead.
        prefetch_misses: runs of a group whose weights were brought in when it started.
        execution_order: the streamed groups in the order the last complete forward ran them.
        group_costs: per group of ``execution_order`` (once each), the last measured bytes
            brought in and seconds of compute: what the residency planner reads.
        link_bytes_per_s: bytes per second of those groups' transfers (0.0 before any).
        widened_bytes: bytes held now by the buffers that narrow weights are widened into
            where no kernel reads them directly (at most one per thread, the size of the
            largest widened weight; 0 while every call takes a narrow-weight kernel).
        storage_bytes_read: bytes the last complete forward read from the checkpoint file
            (``offload(storage=...)``): its groups of the disk tier, and those of the host tier
            read the first time (read ahead or not, counted in the forward that used them).
        peak_host_bytes: most bytes of the checkpoint's weights the host tier kept at once
            (at most ``host_budget``; the read buffers of the groups read on every forward,
            :func:`~torchsurgery.offloading.file_reader.read_buffers` of the largest, come besides).
        achieved_gbps: bytes moved per second of transferring.

    Timings come from events recorded through the offload's
    :class:`~torchsurgery._device.OffloadDevice`, so they are read the same way on a
    CPU, a GPU and the test suite's device (``tests/tardy``).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> handle = torchsurgery.offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, groups="leaves")
        >>> with torch.no_grad():
        ...     _ = model(torch.ones(1, 4))
        >>> handle.stats().streamed_groups
        ['0', '1']
        >>> _ = handle.remove()
    """

    bytes_moved: int = 0
    transfers: int = 0
    seconds_waiting: float = 0.0
    peak_device_bytes: int = 0
    resident_bytes: int = 0
    resident_groups: list[str] = field(default_factory=list)
    streamed_groups: list[str] = field(default_factory=list)
    hint: str = ""
    seconds_transferring: float = 0.0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    execution_order: list[str] = field(default_factory=list)
    group_costs: list[GroupCost] = field(default_factory=list)
    link_bytes_per_s: float = 0.0
    widened_bytes: int = 0
    storage_bytes_read: int = 0
    peak_host_bytes: int = 0

    @property
    def achieved_gbps(self) -> float:
        """Bytes moved per second of transferring, in GB/s (0.0 before any transfer)."""
        return self.bytes_moved / self.seconds_transferring / 1e9 if self.seconds_transferring > 0 else 0.0


