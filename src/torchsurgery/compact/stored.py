"""Making, reading and unmaking an :class:`~torchsurgery.compact.OffloadedTensor` from outside it.

What the offload pillar asks of a weight it stores narrower: the object to swap in
(:func:`offloaded_like`), its values as kept (:func:`stored_values`, :func:`stored_state`),
new memory or new values for them (:func:`rehome`, :func:`load_scaled`, :func:`rescale`), and
whether a module's conversion or patches leave it as it is (:func:`converted_by`,
:func:`plain_reader`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchsurgery._swap import user_attributes
from torchsurgery.compact.narrow import prepare_kernel
from torchsurgery.compact.scaled import Scaled, dequantize
from torchsurgery.compact.shadows import Shadow
from torchsurgery.compact.tensor import OffloadedTensor, ReadContext, own_scale
from torchsurgery.compact.values import SCALE, SHADOW, STORED
from torchsurgery.patching import Patch, patches

__all__ = [
    "stored_values",
    "rehome",
    "load_scaled",
    "rescale",
    "reads_elsewhere_only",
    "converted_by",
    "plain_reader",
    "offloaded_like",
    "stored_state",
]


def stored_values(tensor: torch.Tensor) -> torch.Tensor:
    """What ``tensor`` keeps in memory: an :class:`OffloadedTensor`'s :attr:`~OffloadedTensor.stored`, else itself.

    For measuring what a model takes (``stored_values(p).nbytes``) and reading its raw values.

    Example:
        >>> import torch
        >>> from torchsurgery.compact import stored_values
        >>> stored_values(torch.ones(2)).dtype
        torch.float32
    """
    return tensor.stored if isinstance(tensor, OffloadedTensor) else tensor


def rehome(weight: OffloadedTensor, stored: torch.Tensor | None, scale: torch.Tensor | None = None) -> None:
    """Keep ``weight``'s values in ``stored`` (and a scaled weight's scale in ``scale``) from now on.

    The values are the same, in new memory (a packed group's flat host copy, a slot): every
    view, version counter and master's narrow copy follows them.

    Example:
        >>> import torch
        >>> from torchsurgery.compact import OffloadedTensor, rehome
        >>> w = OffloadedTensor(torch.ones(2, dtype=torch.bfloat16), torch.float32)
        >>> home = torch.full((2,), 3.0, dtype=torch.bfloat16)
        >>> rehome(w, home)
        >>> w.stored.data_ptr() == home.data_ptr(), w.tolist()
        (True, [3.0, 3.0])
    """
    if stored is not None:
        weight._rehome(stored)
    if scale is not None:
        weight._rehome_scale(scale)


def load_scaled(tensor: OffloadedTensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Give the scaled weight ``tensor`` the values ``q * scale`` (``scale``: one number, fp32).

    Values in the weight's own narrow dtype are taken as they are: ``q`` bit for bit, and
    ``scale`` as the scale of every channel (a scale per tensor is a valid one per channel).
    Another narrow dtype (e5m2 values for an e4m3fn weight) is quantised again, with a new
    scale of the weight's granularity, from the values it stands for.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> from torchsurgery.compact import Scaled
        >>> from torchsurgery.compact import load_scaled
        >>> layer = nn.Linear(2, 2)
        >>> handle = torchsurgery.offload(layer, storage_dtype=Scaled(torch.float8_e4m3fn), groups=[""])
        >>> load_scaled(layer.weight, torch.ones(2, 2, dtype=torch.float8_e4m3fn), torch.tensor(0.5))
        >>> layer.weight.tolist()
        [[0.5, 0.5], [0.5, 0.5]]
        >>> _ = handle.remove()
    """
    own = _own_scale_of(tensor, "load_scaled")
    if q.dtype != tensor.stored.dtype:
        rescale(tensor, dequantize(q, scale, torch.float32))
        return
    with torch.no_grad():
        tensor.stored.copy_(q)  # counts in the stored values' version counter: copies kept by version see it
        own.copy_(scale)


def rescale(tensor: OffloadedTensor, values: torch.Tensor) -> None:
    """Give the scaled weight ``tensor`` the plain ``values``, with a new scale chosen from them.

    The scale has the weight's granularity (one per channel, or one for the tensor), chosen as
    :meth:`~torchsurgery.compact.scaled.Scaled.quantize` chooses it: a load of new values must
    not keep the scale of the values it replaces (a write, such as an optimizer step, keeps it).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> from torchsurgery.compact import Scaled
        >>> from torchsurgery.compact import rescale
        >>> layer = nn.Linear(2, 2)
        >>> handle = torchsurgery.offload(layer, storage_dtype=Scaled(torch.int8), groups=[""])
        >>> rescale(layer.weight, torch.tensor([[127.0, -64.0], [0.5, 0.25]]))
        >>> layer.weight[0].tolist(), torchsurgery.compact.own_scale(layer.weight).flatten().tolist()
        ([127.0, -64.0], [1.0, 0.003937007859349251])
        >>> _ = handle.remove()
    """
    own = _own_scale_of(tensor, "rescale")
    stored = tensor.stored
    fmt = Scaled(stored.dtype, "channel" if own.numel() > 1 or stored.dtype == torch.int8 else "tensor")
    q, scale = fmt.quantize(values.to(stored.device))
    with torch.no_grad():
        stored.copy_(q)
        own.copy_(scale)


def _own_scale_of(tensor: torch.Tensor, what: str) -> torch.Tensor:
    own = own_scale(tensor)
    if own is None:
        dtype = tensor.stored.dtype if isinstance(tensor, OffloadedTensor) else tensor.dtype
        raise TypeError(f"torchsurgery: {what} needs a weight stored with a scale, got one stored as {dtype}")
    return own


def reads_elsewhere_only(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an :class:`OffloadedTensor` whose stored values differ from it only in where they are.

    Plain values in its own dtype, kept on another device than the one it reads as (a
    ``DynamicSwapInstaller``'s weight installed with a ``device``): a surgery that moves
    weights itself can take the stored values as the plain tensor they are.

    Example:
        >>> import torch
        >>> from torchsurgery.compact import reads_elsewhere_only
        >>> reads_elsewhere_only(torch.ones(2))
        False
    """
    if not isinstance(tensor, OffloadedTensor):
        return False
    d = tensor.__dict__
    stored: torch.Tensor = d[STORED]
    return d[SHADOW] is None and type(stored) is torch.Tensor and stored.dtype == tensor.dtype and stored.device != tensor.device


def converted_by(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> str | None:
    """The first tensor of ``module``'s subtree that ``Module._apply(fn)`` would change, if any.

    ``fn`` is what ``.to()``, ``.half()``, ``.cuda()``... apply to every tensor; one that
    returns the tensor itself changes nothing (``model.to("cpu")`` of a model on the CPU).
    """
    with torch.no_grad():
        for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
            # a weight whose values are in a checkpoint file (stored ``meta``) has none to convert:
            # a stand-in of its dtype and device shows what ``fn`` would do
            probe = torch.empty((0,) * t.dim(), dtype=t.dtype, device=t.device) if stored_values(t).is_meta and not t.is_meta else t
            if fn(probe) is not probe:
                return name
    return None


def plain_reader(module: nn.Module) -> type[Patch] | None:
    """The patch of ``module`` that reads its weights' memory directly (it cannot serve an OffloadedTensor), if any."""
    return next((p for p in patches(module) if p.__patch_needs_plain_weights__), None)


def offloaded_like(
    tensor: torch.Tensor,
    stored: torch.Tensor,
    dtype: torch.dtype,
    *,
    reads: ReadContext | None = None,
    shadow_dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The object to swap into ``tensor`` so that it reads as ``dtype`` on ``device`` with ``stored`` as its values.

    ``scale`` (a scaled weight, :mod:`torchsurgery.compact.scaled`) makes it read as
    ``stored * scale``. ``device`` (default: where ``stored`` is) is where it computes: a weight kept in host
    memory for a model offloaded to an accelerator reads as a tensor there. A parameter
    stays a parameter (``isinstance``, ``requires_grad``); attributes the user set on the
    tensor object are carried along.
    """
    wrapper = OffloadedTensor(stored, dtype, reads=reads, device=device, scale=scale)
    prepare_kernel(shadow_dtype if shadow_dtype is not None else stored.dtype, stored.device)
    if shadow_dtype is not None:  # follows the very tensor the wrapper keeps (copies keep the link)
        wrapper.__dict__[SHADOW] = Shadow(wrapper.stored, shadow_dtype)
    new: torch.Tensor = wrapper
    if isinstance(tensor, nn.Parameter):
        new = nn.Parameter(new, requires_grad=tensor.requires_grad)
    elif tensor.requires_grad:
        new.requires_grad_(True)
    new.__dict__.update(user_attributes(tensor))
    return new


def stored_state(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """A ``state_dict`` post-hook: offloaded tensors appear as their stored values.

    ``state_dict()`` is what programs save (``torch.save``, ``save_pretrained`` through
    safetensors, which reads memory): it holds plain tensors aliasing what the model keeps,
    so saving writes the compact values without widening the model in memory and loading
    them back gives exactly those values. ``state_dict(keep_vars=True)`` keeps the objects.
    """
    d = module.__dict__
    for name, value in itertools.chain(d["_parameters"].items(), d["_buffers"].items()):
        entry = state_dict.get(prefix + name)
        # with keep_vars=True the entry is the tensor object itself: left as it is
        if isinstance(value, OffloadedTensor) and isinstance(entry, OffloadedTensor) and entry is not value:
            # a scaled weight's values are q * scale: given in the compute dtype, made where they are
            # kept (the host, for a weight an accelerator streams: none of it stays on the device)
            scale = value.__dict__[SCALE]
            stored = value.stored
            state_dict[prefix + name] = (
                _own_storage(stored) if scale is None else dequantize(stored, scale.to(stored.device), value.dtype)
            )


def _own_storage(values: torch.Tensor) -> torch.Tensor:
    """``values``, on a storage of their own where they share one (a packed group's buffer).

    safetensors and ``save_pretrained`` take tensors on one storage for shared (tied)
    memory and refuse to save those that do not cover it; the plain model's weights each
    have their own. The same memory, seen through a storage that starts and ends with the
    values (numpy's view keeps the buffer alive), so nothing is copied.
    """
    if values.device.type != "cpu" or not values.is_contiguous() or values.untyped_storage().nbytes() == values.nbytes:
        return values
    memory = values.reshape(-1).view(torch.uint8).numpy()
    return torch.from_numpy(memory).view(values.dtype).view(values.shape)
