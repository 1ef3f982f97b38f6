"""A behavioural reference of the FramePack app's memory module (``diffusers_helper/memory.py``).

Written here from the app's documented behaviour, for the tests to compare
``torchsurgery.compat.framepack`` against: the same function names, plain ``.to()``
moves, free memory read from the accelerator's own statistics, and the same lines
printed at the same points:

* ``move_model_to_device_with_memory_preservation`` prints ``Moving ...``, then walks
  ``model.modules()`` and moves each module that has a ``weight`` to the device until
  the free memory is at most the preserved amount (then stops); when the walk ends, the
  whole model is moved;
* ``offload_model_from_device_for_memory_preservation`` prints ``Offloading ...``, then
  walks the modules the same way, moving each with a ``weight`` back to the host until
  at least the preserved amount is free; when the walk ends, the whole model goes back;
* ``load_model_as_complete`` unloads the complete models first (unless ``unload=False``),
  moves the model, prints ``Loaded ... as complete.`` and remembers it;
* ``unload_complete_models`` moves every remembered model and each extra one to the host,
  printing ``Unloaded ... as complete.`` for each, and forgets them;
* ``fake_diffusers_current_device`` moves a ``scale_shift_table`` if the model has one,
  else the first module that has a ``weight``;
* ``DynamicSwapInstaller`` swaps each module's class for one whose attribute reads return
  its parameters and buffers converted with ``Tensor.to(**kwargs)`` (new ``Parameter``s).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

cpu = torch.device("cpu")
_complete: list[nn.Module] = []
_GIB = 1024**3


def get_cuda_free_memory_gb(device: torch.device) -> float:
    """What the device reports free plus what the caching allocator holds unused, in GiB."""
    stats = torch.accelerator.memory_stats(device)
    free, _ = torch.accelerator.get_memory_info(device)
    unused = stats.get("reserved_bytes.all.current", 0) - stats.get("active_bytes.all.current", 0)
    return (free + unused) / _GIB


def move_model_to_device_with_memory_preservation(model: nn.Module, target_device: Any, preserved_memory_gb: float = 0) -> None:
    print(f"Moving {type(model).__name__} to {target_device} with preserved memory: {preserved_memory_gb} GB")
    _walk(model, target_device, lambda free: free <= preserved_memory_gb, target_device)


def offload_model_from_device_for_memory_preservation(
    model: nn.Module, target_device: Any, preserved_memory_gb: float = 0
) -> None:
    print(f"Offloading {type(model).__name__} from {target_device} to preserve memory: {preserved_memory_gb} GB")
    _walk(model, target_device, lambda free: free >= preserved_memory_gb, cpu)


def _walk(model: nn.Module, watched: Any, done: Any, to: Any) -> None:
    """Move ``model``'s modules that have a weight to ``to``, one at a time, until ``done(free GiB of
    watched)``; the whole model where that never comes."""
    for module in model.modules():
        if done(get_cuda_free_memory_gb(watched)):
            torch.accelerator.empty_cache()
            return
        if hasattr(module, "weight"):
            module.to(device=to)
    model.to(device=to)
    torch.accelerator.empty_cache()


def unload_complete_models(*extra: nn.Module) -> None:
    for model in [*_complete, *extra]:
        model.to(device=cpu)
        print(f"Unloaded {type(model).__name__} as complete.")
    _complete.clear()
    torch.accelerator.empty_cache()


def load_model_as_complete(model: nn.Module, target_device: Any, unload: bool = True) -> None:
    if unload:
        unload_complete_models()
    model.to(device=target_device)
    print(f"Loaded {type(model).__name__} to {target_device} as complete.")
    _complete.append(model)


def fake_diffusers_current_device(model: nn.Module, target_device: Any) -> None:
    if hasattr(model, "scale_shift_table"):
        model.scale_shift_table.data = model.scale_shift_table.data.to(target_device)
        return
    first = next((m for m in model.modules() if hasattr(m, "weight")), None)
    if first is not None:
        first.to(target_device)


_ORIGINAL = "_reference_original_class"


class DynamicSwapInstaller:
    """Attribute reads of parameters and buffers come back converted (new objects)."""

    @staticmethod
    def _install_module(module: nn.Module, **kwargs: Any) -> None:
        original = type(module)

        def read(self: nn.Module, name: str) -> Any:
            params, buffers = self.__dict__.get("_parameters", {}), self.__dict__.get("_buffers", {})
            if name in params:
                p = params[name]
                if p is None:
                    return None
                if type(p) is nn.Parameter:
                    return nn.Parameter(p.to(**kwargs), requires_grad=p.requires_grad)
                return p.to(**kwargs)
            if name in buffers:
                b = buffers[name]
                return None if b is None else b.to(**kwargs)
            return super(original, self).__getattr__(name)  # type: ignore[misc]

        module.__dict__[_ORIGINAL] = original
        # named as the app names it (its log prints the name); str() of the class as the
        # original's, as transformers (newer than the app's) looks up a model's hidden-state
        # recording by str(model.__class__)
        namespace = {"__getattr__": read, "__qualname__": original.__qualname__, "__module__": original.__module__}
        module.__class__ = type("DynamicSwap_" + original.__name__, (original,), namespace)

    @staticmethod
    def install_model(model: nn.Module, **kwargs: Any) -> None:
        for module in model.modules():
            DynamicSwapInstaller._install_module(module, **kwargs)

    @staticmethod
    def uninstall_model(model: nn.Module) -> None:
        for module in model.modules():
            if _ORIGINAL in module.__dict__:
                module.__class__ = module.__dict__.pop(_ORIGINAL)
