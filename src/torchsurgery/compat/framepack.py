"""The low-VRAM memory functions of the FramePack video app, on :class:`~torchsurgery.DevicePool`.

A FramePack script switches by changing one import line::

    from torchsurgery.compat.framepack import (
        cpu, gpu, get_cuda_free_memory_gb, move_model_to_device_with_memory_preservation,
        offload_model_from_device_for_memory_preservation, fake_diffusers_current_device,
        DynamicSwapInstaller, unload_complete_models, load_model_as_complete,
    )

Each target device gets one shared pool (no limit of its own: accelerator pools use what
is free, as the device's memory statistics report it). A model joins the pool of a device the first time a function moves it there, with
its weights in their own dtype; a model you added yourself to a
:class:`~torchsurgery.DevicePool` of that device (with a budget, a storage dtype) stays
in that pool. What changes from moving modules one ``.to()`` at a time:

* a model that does not fit is loaded *partly*: whole offload groups (transformer
  blocks) stay resident up to the memory to preserve, the rest streamed by the offload
  engine at each forward; nothing runs out of memory. Where the memory left is too small
  even for the blocks streamed, single modules are streamed instead (as the app moves each
  module with a ``weight`` while memory allows), one at a time if need be, and one line in
  the app's style says so (``Streaming DynamicSwap_HunyuanVideoTransformer3DModelPacked in
  smaller pieces: its groups need ... more than the ... it may take there; streaming single
  modules (groups='leaves') instead``, once while the model is in the shared pool); only
  where not even one module fits does the model stay on the host. Nothing the app's own
  module runs is refused. :func:`offload_model_from_device_for_memory_preservation` takes back only as
  much as it must to leave the memory to preserve free, as the app does;
* :func:`load_model_as_complete` pushes back other models least recently used first,
  only as far as needed, instead of all of them;
* every move is reversible and recorded: ``torchsurgery.restore(model)`` takes a model
  out of its pool, back on the host as it was;
* a loaded model takes ``.to(dtype)``, ``.float()``, ``.half()`` as the plain model does
  (the app's transformer converts its output projection to fp32 inside ``forward``): the
  offload is planned again in the new dtype (within the memory it was given, in finer
  groups if need be), and undoing it keeps the user's conversion;
* nothing is kept that the app does not need: a model pushed back to the host leaves the
  shared pool (its hook and undo record go with it), and the functions hold no strong
  reference to a model, so one the app drops is freed.

On a CPU (``gpu`` is the CPU when PyTorch reports no accelerator) the models already live in
the memory they would be moved to, so there is no device memory to preserve:
``preserved_memory_gb`` is ignored (the two ``..._memory_preservation`` functions load
and keep the model within its pool's own limit), and :func:`get_cuda_free_memory_gb`
reports the host's available memory (``MemAvailable``). Loading a model into the
default CPU pool moves nothing (its weights are already there, in their dtype); a pool
of your own with a budget and a storage dtype converts them, as on a GPU. A script
runs unchanged and gives the results of plain ``.to()`` moves.

Models streamed from their checkpoint files work the same, their weights never in host
memory: a script that loads them with ``torchsurgery.from_pretrained`` changes, besides the
import, only its ``from_pretrained`` lines::

    text_encoder = LlamaModel.from_pretrained(repo, subfolder="text_encoder", torch_dtype=torch.float16)
    # becomes
    text_encoder = torchsurgery.from_pretrained(LlamaModel, repo, subfolder="text_encoder",
                                                dtype=torch.float16, host_budget=4 << 30)

Such a model joins a device's pool streaming from its files, within its own host budget,
and goes back to computing on the host from them when pushed back; the installer makes it
compute on its device with every weight read from the files at use (see
``torchsurgery/compat/_streamed.py``).

The functions print the app's lines at the same points (``Moving UNet to cuda:0 with
preserved memory: 6 GB``, ``Offloading ... from ... to preserve memory: ... GB``,
``Loaded ... to ... as complete.``, ``Unloaded ... as complete.``), so a script's log reads
the same. Set the module attribute :data:`verbose` to ``False`` to silence them::

    import torchsurgery.compat.framepack as framepack
    framepack.verbose = False
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from torchsurgery._device import AcceleratorDevice, reported_accelerator
from torchsurgery._swap import swap_in, wrap_like
from torchsurgery._validate import check_device
from torchsurgery.compact import stored_values
from torchsurgery.compat import _streamed
from torchsurgery.compat._streamed import DynamicSwapInstaller
from torchsurgery.errors import ArgumentTypeError, ArgumentValueError, Setting
from torchsurgery.offloading import DevicePool

__all__ = [
    "verbose",
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

verbose = True
"""Whether the functions print the app's lines (``Moving ... with preserved memory``, ``Loaded ... as complete.``...)."""


def _say(line: str) -> None:
    if verbose:
        print(line)


def _name(model: nn.Module) -> str:
    """The model's class name as the app prints it (its installer's classes are named ``DynamicSwap_...``)."""
    return ("DynamicSwap_" if DynamicSwapInstaller.installed(model) else "") + type(model).__name__

cpu = torch.device("cpu")
"""The host."""


def _first_accelerator() -> torch.device:
    accelerator = reported_accelerator()
    return cpu if accelerator is None else torch.device(accelerator.type, 0)


gpu = _first_accelerator()
"""The first device of the accelerator PyTorch reports (``cuda:0`` on a GPU), or the CPU
where there is none (the scripts then run on the CPU)."""

_WHAT = "torchsurgery.compat.framepack"
_pools: dict[torch.device, DevicePool] = {}
# loaded with load_model_as_complete, pushed back by unload_complete_models; weak: a model
# the app drops is freed
_complete: list[weakref.ref[nn.Module]] = []
# the models of a shared pool that were told to stream finer groups (said once while in it)
_finer: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _device(device: Any, function: str) -> torch.device:
    target = check_device(device, f"{_WHAT}.{function}")
    if target is None or target.type == "meta":
        raise ArgumentValueError(
            f"{_WHAT}.{function}", "device", device,
            f"{str(device)!r} holds no values: a model moved there cannot compute", "give {}",
            Setting("target_device", "cuda"),
        )
    if target.type != "cpu" and target.index is None:
        target = torch.device(target.type, 0)
    return target


def _model(model: Any, function: str, argument: str = "model") -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(
            f"{_WHAT}.{function}", argument, model, f"must be an nn.Module, got {type(model).__name__}: {model!r}"
        )
    return model


def _is_shared(pool: DevicePool | None) -> bool:
    return pool is not None and _pools.get(pool.device) is pool


def _to_host(model: nn.Module) -> None:
    """Push ``model`` back to the host: out of a shared pool altogether, back within a pool of the user's."""
    pool = DevicePool.holding(model)
    if _is_shared(pool):
        assert pool is not None
        pool.discard(model)
        _finer.discard(model)
        _streamed.put_back(model)  # streamed from its files: back to computing on the host from them
    elif pool is not None:
        pool.unload(model)
    elif not _streamed.streamed(model):  # a streamed model holds no weights to move
        _host_tensors(model)


def _host_tensors(model: nn.Module) -> None:
    """What ``model.to(cpu)`` does, by swapping: the same objects, also for weights an
    installer keeps in their stored dtype (which refuse ``.to()``) and across backends
    ``.data =`` refuses (e.g. what :func:`fake_diffusers_current_device` moved)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        # an installer's weight kept on the host (it reads as the device it computes on) stays as it is
        if stored_values(tensor).device.type != "cpu":
            swap_in(tensor, wrap_like(tensor, tensor.detach().to(cpu)))


def _shared_pool(target: torch.device) -> DevicePool:
    """The one pool of ``target`` that models join when a function moves them there."""
    pool = _pools.get(target)
    if pool is None:
        pool = _pools[target] = DevicePool(target, on_fallback=_say_finer)
    return pool


def _say_finer(model: nn.Module, sentence: str) -> None:
    """Print, once while ``model`` is in a shared pool, that its groups had no room and which finer
    ones it streams instead (the memory left to it was too small for its blocks)."""
    if model not in _finer:
        _finer.add(model)
        _say(f"Streaming {_name(model)} in smaller pieces: {sentence}")


def _pool_for(model: nn.Module, target: torch.device) -> DevicePool:
    """The shared pool of ``target``, with ``model`` in it (moved over from another pool)."""
    pool = _shared_pool(target)
    holder = DevicePool.holding(model)
    if holder is not None and holder.device == target:
        return holder
    if holder is not pool:
        if holder is not None:
            holder.discard(model)
        pool.add(model, **_streamed.take_off(model))  # streamed: from the same files
    return pool


def get_cuda_free_memory_gb(device: str | torch.device | None = None) -> float:
    """GiB a new allocation on ``device`` (default ``gpu``) can take now.

    On an accelerator: free on the device plus what torch's allocator holds unused (from
    ``torch.accelerator``'s memory statistics). On a CPU: the host's available memory.

    Example:
        >>> from torchsurgery.compat.framepack import cpu, get_cuda_free_memory_gb
        >>> get_cuda_free_memory_gb(cpu) > 0
        True
    """
    return _shared_pool(_device(device if device is not None else gpu, "get_cuda_free_memory_gb")).free_bytes() / _GIB


def move_model_to_device_with_memory_preservation(
    model: nn.Module, target_device: str | torch.device, preserved_memory_gb: float = 0
) -> None:
    """Bring ``model`` to ``target_device`` while ``preserved_memory_gb`` GiB stay free there.

    What fits goes in as whole offload groups (transformer blocks), or module by module
    where the memory left is too small for the groups streamed (one line says so); the rest
    is streamed by the offload engine at each forward. When not even one module fits, the
    model stays on the host. Prints the app's
    ``Moving ... with preserved memory: ... GB`` line first (see :data:`verbose`).

    Example:
        >>> from torch import nn
        >>> from torchsurgery.compat.framepack import cpu, move_model_to_device_with_memory_preservation
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> move_model_to_device_with_memory_preservation(model, cpu, preserved_memory_gb=0)
        Moving Sequential to cpu with preserved memory: 0 GB
        >>> model[0].weight.device.type
        'cpu'
    """
    what = "move_model_to_device_with_memory_preservation"
    model = _model(model, what)
    target = _device(target_device, what)
    _say(f"Moving {_name(model)} to {target_device} with preserved memory: {preserved_memory_gb} GB")
    if target.type == "cpu" and _streamed.on_host(model):
        return  # streamed from its files, it computes on the host already
    pool = _pool_for(model, target)
    keep = None if pool.device.type == "cpu" else int(preserved_memory_gb * _GIB)
    # where not even the ring's blocks have room, the shared pool streams single modules (as the
    # app moves each module with a weight while memory allows) and says so (_say_finer)
    if pool.try_load(model, keep_free=keep) is None and _is_shared(pool) and _streamed.streamed(model):
        _to_host(model)  # not even one module fits: it computes on the host, from its files


def offload_model_from_device_for_memory_preservation(
    model: nn.Module, target_device: str | torch.device, preserved_memory_gb: float = 0
) -> None:
    """Take back as much of ``model`` as needed for ``preserved_memory_gb`` GiB to be free on ``target_device``.

    As the app does, nothing moves while that much is free; otherwise the model keeps the
    groups that still leave that much free (planned again, the rest streamed), or goes back
    to the host whole when what is left is below what it needs streamed. Its groups come in
    again at the next move. A model no pool of ``target_device`` holds goes back to the host
    when too little is free. A no-op on a CPU target. Prints the app's ``Offloading ... to
    preserve memory: ... GB`` line first (see :data:`verbose`).

    Example:
        >>> from torch import nn
        >>> from torchsurgery.compat.framepack import cpu, offload_model_from_device_for_memory_preservation
        >>> offload_model_from_device_for_memory_preservation(nn.Linear(2, 2), cpu, preserved_memory_gb=0)
        Offloading Linear from cpu to preserve memory: 0 GB
    """
    what = "offload_model_from_device_for_memory_preservation"
    model = _model(model, what)
    target = _device(target_device, what)
    _say(f"Offloading {_name(model)} from {target_device} to preserve memory: {preserved_memory_gb} GB")
    keep = int(preserved_memory_gb * _GIB)
    pool = DevicePool.holding(model)
    if target.type == "cpu" or _shared_pool(target).free_bytes() >= keep:
        return
    if pool is None or pool.device != target:
        _to_host(model)
    elif pool.shrink(model, keep_free=keep) is None and _is_shared(pool):
        _to_host(model)  # back on the host: out of the shared pool


def load_model_as_complete(model: nn.Module, target_device: str | torch.device, unload: bool = True) -> None:
    """Bring ``model`` to ``target_device`` whole, after the models loaded this way before.

    Args:
        model: the model.
        target_device: where it goes.
        unload: first push back every model loaded with this function (as the app
            does); otherwise they stay and are pushed back only as far as needed.

    A model too large to fit whole even alone is loaded partly, its remaining groups
    streamed, instead of running out of memory. Prints the app's ``Loaded ... as
    complete.`` line (see :data:`verbose`).

    Example:
        >>> from torch import nn
        >>> from torchsurgery.compat.framepack import cpu, load_model_as_complete, unload_complete_models
        >>> vae = nn.Linear(4, 4)
        >>> load_model_as_complete(vae, cpu, unload=False)
        Loaded Linear to cpu as complete.
        >>> unload_complete_models()
        Unloaded Linear as complete.
    """
    model = _model(model, "load_model_as_complete")
    target = _device(target_device, "load_model_as_complete")
    if unload:
        unload_complete_models()
    if target.type != "cpu" or not _streamed.on_host(model):  # streamed: it computes on the host already
        _pool_for(model, target).load(model)
    _say(f"Loaded {_name(model)} to {target_device} as complete.")
    _complete.append(weakref.ref(model))  # as the app's list: loaded twice, unloaded (and printed) twice


def unload_complete_models(*extra_models: nn.Module) -> None:
    """Push back every model loaded with :func:`load_model_as_complete`, and ``extra_models``.

    An extra model that no pool holds is moved to the host with ``.to("cpu")``. Prints the
    app's ``Unloaded ... as complete.`` line for each (see :data:`verbose`).

    Example:
        >>> from torch import nn
        >>> from torchsurgery.compat import framepack
        >>> framepack.unload_complete_models()  # clear the list of earlier loads
        >>> framepack.unload_complete_models(nn.Embedding(2, 2))
        Unloaded Embedding as complete.
        >>> framepack.verbose = False  # silenced
        >>> framepack.unload_complete_models(nn.Embedding(2, 2))
        >>> framepack.verbose = True
    """
    extra = [_model(m, "unload_complete_models", "extra_models") for m in extra_models]
    for model in [*(m for m in (ref() for ref in _complete) if m is not None), *extra]:
        _to_host(model)
        _say(f"Unloaded {_name(model)} as complete.")
    _complete.clear()
    accelerator = reported_accelerator()
    if accelerator is not None:
        AcceleratorDevice(accelerator).empty_cache()  # a no-op before the device's allocator is initialised


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
    model = _model(model, "fake_diffusers_current_device")
    target = _device(target_device, "fake_diffusers_current_device")
    first = next(iter(model.parameters()), None)
    # streamed from its files, its weights are nowhere but there (``meta``): it computes where its offload does
    if first is not None and first.device != target and not _streamed.streamed(model):
        # swapped, not `.data =`: torch refuses that between the host and a backend it does
        # not know as dense (any registered PrivateUse1 backend)
        swap_in(first, wrap_like(first, first.detach().to(target)))
