"""What a weight answers to the tensor methods that ask about its memory or read its values out.

An :class:`~torchsurgery.compact.OffloadedTensor` routes these methods here (its
``__torch_function__`` looks them up in ``METHODS``); they read the weight through
its fields (:mod:`torchsurgery.compact.values`), not through the class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from torchsurgery.compact.exporting import described_for_fakes
from torchsurgery.compact.shadows import Shadow
from torchsurgery.compact.values import READS, SCALE, SHADOW, store, wide, written_in_place

__all__ = ["METHODS"]

# What a program asks of a tensor's memory is answered by the stored values: they are the
# memory the weight has (its data_ptr and storage, what is shared or pinned). Values read
# out (numpy, tolist) are the values it computes with, in its dtype: a narrow weight's numpy
# array is a widened copy, a weight stored in its own dtype shares its memory as a plain
# tensor does.


_DATA: Any = vars(torch._C.TensorBase)["data"]  # the `.data` property: its setter is what `t.data = x` calls


def _stored(t: torch.Tensor) -> torch.Tensor:
    """The values ``t`` keeps (an OffloadedTensor's ``stored``)."""
    stored: torch.Tensor = cast(Any, t).stored
    return stored


def _data_ptr(t: torch.Tensor) -> int:
    return _stored(t).data_ptr()


def _untyped_storage(t: torch.Tensor) -> torch.UntypedStorage:
    if described_for_fakes():  # torch.export's fake copy of the weight: the wrapper's own (compact/exporting.py)
        return torch.Tensor.untyped_storage(t)
    return _stored(t).untyped_storage()


def _share_memory(t: torch.Tensor) -> torch.Tensor:
    _stored(t).share_memory_()  # moves the storage itself: every view and alias of the values follows
    shadow = t.__dict__[SHADOW]
    if isinstance(shadow, Shadow):
        shadow.copy.share_memory_()
    return t


def _is_shared(t: torch.Tensor) -> bool:
    return _stored(t).is_shared()


def _is_pinned(t: torch.Tensor, device: Any = None) -> bool:
    return _stored(t).is_pinned() if device is None else _stored(t).is_pinned(device)


def _pin_memory(t: torch.Tensor, device: Any = None) -> torch.Tensor:
    pinned = _stored(t).pin_memory() if device is None else _stored(t).pin_memory(device)
    weight: Any = type(t)  # the weight's class: a weight of its kind over the pinned values
    return weight(pinned, t.dtype, reads=t.__dict__[READS], device=t.device, scale=t.__dict__[SCALE])


def _values_out(t: torch.Tensor, force: bool = False) -> torch.Tensor:
    if t.requires_grad and not force:  # as torch refuses it for a plain tensor
        raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
    return wide(t)


def _numpy(t: torch.Tensor, *, force: bool = False) -> Any:
    return _values_out(t, force).numpy(force=force)


def _array(t: torch.Tensor, dtype: Any = None) -> Any:
    return torch.Tensor.__array__(_values_out(t), dtype)


def _tolist(t: torch.Tensor) -> Any:
    return wide(t).tolist()


def _set_data(t: torch.Tensor, new: Any) -> None:
    """``t.data = new``: ``t`` computes with ``new``'s values from now on, rounded to its storage dtype.

    Values of the same shape are written into the memory ``t`` keeps (a streamed group's
    host buffer stays the one it streams from, copies kept by version see the write);
    another shape or device gets new memory, and ``t`` takes its shape. A plain tensor's
    ``.data =`` shares ``new``'s memory instead; a narrow weight cannot share wider values.
    """
    if not isinstance(new, torch.Tensor):
        _DATA.__set__(t, new)  # torch's own refusal
    if new.dtype != t.dtype:
        raise TypeError(
            f"torchsurgery: cannot set .data of a weight that reads as {t.dtype} (stored as {_stored(t).dtype}) "
            f"to a {new.dtype} tensor; convert the module instead (module.to({new.dtype}) or "
            "torchsurgery.convert_), or remove the offload first"
        )
    values = _stored(new) if isinstance(new, type(t)) else new.detach()
    stored = _stored(t)
    here = new.device == t.device  # values where it computes: kept where it keeps its values
    scaled = t.__dict__[SCALE] is not None
    if scaled and isinstance(new, type(t)) and new.__dict__[SCALE] is not None:
        values = wide(new)
    if here and values.shape == stored.shape and values.stride() == stored.stride():
        store(t, values)
        written_in_place(t)
        return
    if scaled:
        raise TypeError(
            f"torchsurgery: cannot set .data of a scaled weight of shape {list(t.shape)} to a tensor of shape "
            f"{list(new.shape)} on {new.device}; write values of its shape in place, or remove the offload first"
        )
    kept = values.to(device=stored.device if here else values.device, dtype=stored.dtype)
    weight: Any = type(t)  # the weight's class: a weight of its kind over the new values
    _DATA.__set__(t, weight(kept, t.dtype, device=new.device))  # the wrapper's shape, strides, device
    cast(Any, t)._rehome(kept)
    shadow = t.__dict__[SHADOW]
    if isinstance(shadow, Shadow):
        t.__dict__[SHADOW] = Shadow(kept, shadow.copy.dtype)


METHODS: dict[Any, Callable[..., Any]] = {
    torch.Tensor.data_ptr: _data_ptr,
    torch.Tensor.untyped_storage: _untyped_storage,
    torch.Tensor.share_memory_: _share_memory,
    torch.Tensor.is_shared: _is_shared,
    torch.Tensor.is_pinned: _is_pinned,
    torch.Tensor.pin_memory: _pin_memory,
    torch.Tensor.numpy: _numpy,
    torch.Tensor.__array__: _array,
    torch.Tensor.tolist: _tolist,
    _DATA.__set__: _set_data,
}
