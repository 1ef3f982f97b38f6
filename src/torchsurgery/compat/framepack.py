"""The low-VRAM memory functions of the FramePack video app, on :class:`~torchsurgery.DevicePool`.

A FramePack script switches by changing one import line::

    from torchsurgery.compat.framepack import (
        cpu, gpu, get_cuda_free_memory_gb, move_model_to_device_with_memory_preservation,
        offload_model_from_device_for_memory_preservation, fake_diffusers_current_device,
        DynamicSwapInstaller, unload_complete_models, load_model_as_complete,
    )

Each target device gets one shared pool (no limit of its own: GPU pools use what is
free). A model joins the pool of a device the first time a function moves it there, with
its weights in their own dtype; a model you added yourself to a
:class:`~torchsurgery.DevicePool` of that device (with a budget, a storage dtype) stays
in that pool. What changes from moving modules one ``.to()`` at a time:

* a model that does not fit is loaded *partly*: whole offload groups (transformer
  blocks) stay resident up to the memory to preserve, the rest are streamed group by
  group by the offload engine at each forward; nothing runs out of memory;
* :func:`load_model_as_complete` pushes back other models least recently used first,
  only as far as needed, instead of all of them;
* every move is reversible and recorded: ``torchsurgery.restore(model)`` takes a model
  out of its pool, back on the host as it was.

On a CPU (``gpu`` is the CPU when no CUDA device exists) the models already live in
the memory they would be moved to, so there is no device memory to preserve:
``preserved_memory_gb`` is ignored (the two ``..._memory_preservation`` functions load
and keep the model within its pool's own limit), and :func:`get_cuda_free_memory_gb`
reports the host's available memory (``MemAvailable``). Loading a model into the
default CPU pool moves nothing (its weights are already there, in their dtype); a pool
of your own with a budget and a storage dtype converts them, as on a GPU. A script
runs unchanged and gives the results of plain ``.to()`` moves.
"""

from __future__ import annotations

import torch
from torch import nn

from torchsurgery.offloading.dynamic_swap import DynamicSwapInstaller
from torchsurgery.offloading.pool import DevicePool

__all__ = [
    "cpu",
    "gpu",
    "get_cuda_free_memory_gb",
    "move_model_to_device_with_memory_preservation",
    "offload_model_from_device_for_memory_preservation",
    "load_model_as_complete",
    "unload_complete_models",
    "fake_diffusers_current_device",
    "DynamicSwapInstaller",
]

_GIB = 1 << 30

cpu = torch.device("cpu")
"""The host."""

gpu = torch.device("cuda", 0) if torch.cuda.is_available() else cpu
"""The first CUDA device, or the CPU where there is none (the scripts then run on the CPU)."""

_pools: dict[torch.device, DevicePool] = {}
_complete: list[nn.Module] = []  # loaded with load_model_as_complete, pushed back by unload_complete_models


def _device(device: str | torch.device) -> torch.device:
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", 0)
    return target


def _shared_pool(device: str | torch.device) -> DevicePool:
    """The one pool of ``device`` that models join when a function moves them there."""
    target = _device(device)
    pool = _pools.get(target)
    if pool is None:
        pool = _pools[target] = DevicePool(target)
    return pool


def _pool_for(model: nn.Module, device: str | torch.device) -> DevicePool:
    """The shared pool of ``device``, with ``model`` in it (moved over from another pool)."""
    pool = _shared_pool(device)
    target = pool.device
    holder = DevicePool.holding(model)
    if holder is not None and holder.device == target:
        return holder
    if holder is not pool:
        if holder is not None:
            holder.discard(model)
        pool.add(model)
    return pool


def get_cuda_free_memory_gb(device: str | torch.device | None = None) -> float:
    """GiB a new allocation on ``device`` (default ``gpu``) can take now.

    On a GPU: free in the driver plus what torch's allocator holds unused. On a CPU:
    the host's available memory.

    Example:
        >>> from torchsurgery.compat.framepack import cpu, get_cuda_free_memory_gb
        >>> get_cuda_free_memory_gb(cpu) > 0
        True
    """
    return _shared_pool(device if device is not None else gpu).free_bytes() / _GIB


def move_model_to_device_with_memory_preservation(
    model: nn.Module, target_device: str | torch.device, preserved_memory_gb: float = 0
) -> None:
    """Bring ``model`` to ``target_device`` while ``preserved_memory_gb`` GiB stay free there.

    What fits goes in as whole offload groups; the rest is streamed by the offload
    engine at each forward. When not even one group fits, the model stays on the host.

    Example:
        >>> from torch import nn
        >>> from torchsurgery.compat.framepack import cpu, move_model_to_device_with_memory_preservation
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> move_model_to_device_with_memory_preservation(model, cpu, preserved_memory_gb=0)
        >>> model[0].weight.device.type
        'cpu'
    """
    pool = _pool_for(model, target_device)
    keep = None if pool.device.type == "cpu" else int(preserved_memory_gb * _GIB)
    pool.try_load(model, keep_free=keep)  # not even one group fits: the model stays on the host


def offload_model_from_device_for_memory_preservation(
    model: nn.Module, target_device: str | torch.device, preserved_memory_gb: float = 0
) -> None:
    """Push ``model`` back to the host unless ``preserved_memory_gb`` GiB are free on ``target_device``.

    The model goes back whole (its groups come in again at the next move). A no-op on
    a CPU target.

    Example:
        >>> from torch import nn
        >>> from torchsurgery.compat.framepack import cpu, offload_model_from_device_for_memory_preservation
        >>> offload_model_from_device_for_memory_preservation(nn.Linear(2, 2), cpu, preserved_memory_gb=0)
    """
    target = _device(target_device)
    if target.type == "cpu" or _shared_pool(target).free_bytes() >= preserved_memory_gb * _GIB:
        return
    pool = DevicePool.holding(model)
    if pool is not None:
        pool.unload(model)
    else:
        model.to(device=cpu)


def load_model_as_complete(model: nn.Module, target_device: str | torch.device, unload: bool = True) -> None:
    """Bring ``model`` to ``target_device`` whole, after the models loaded this way before.

    Args:
        model: the model.
        target_device: where it goes.
        unload: first push back every model loaded with this function (as the app
            does); otherwise they stay and are pushed back only as far as needed.

    A model too large to fit whole even alone is loaded partly, its remaining groups
    streamed, instead of running out of memory.

    Example:
        >>> from torch import nn
        >>> from torchsurgery.compat.framepack import cpu, load_model_as_complete, unload_complete_models
        >>> vae = nn.Linear(4, 4)
        >>> load_model_as_complete(vae, cpu)
        >>> unload_complete_models()
    """
    if unload:
        unload_complete_models()
    pool = _pool_for(model, target_device)
    pool.load(model)
    if not any(m is model for m in _complete):
        _complete.append(model)


def unload_complete_models(*extra_models: nn.Module) -> None:
    """Push back every model loaded with :func:`load_model_as_complete`, and ``extra_models``.

    An extra model that no pool holds is moved to the host with ``.to("cpu")``.

    Example:
        >>> from torch import nn
        >>> from torchsurgery.compat.framepack import unload_complete_models
        >>> unload_complete_models(nn.Linear(2, 2))
    """
    for model in [*_complete, *extra_models]:
        pool = DevicePool.holding(model)
        if pool is not None:
            pool.unload(model)
        else:
            model.to(device=cpu)
    _complete.clear()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def fake_diffusers_current_device(model: nn.Module, target_device: str | torch.device) -> None:
    """Make ``model.device`` report ``target_device`` while the model stays on the host.

    diffusers and transformers read a model's device from its first parameter, and
    pipelines put their inputs there; that one parameter is moved (in place: the same
    object) so that inputs land on ``target_device``, where an installed
    :class:`DynamicSwapInstaller` brings the other weights at use.

    Example:
        >>> from torch import nn
        >>> from torchsurgery.compat.framepack import cpu, fake_diffusers_current_device
        >>> model = nn.Linear(2, 2)
        >>> fake_diffusers_current_device(model, cpu)
        >>> model.weight.device.type
        'cpu'
    """
    target = _device(target_device)
    first = next(iter(model.parameters()), None)
    if first is not None and first.device != target:
        first.data = first.data.to(target)
