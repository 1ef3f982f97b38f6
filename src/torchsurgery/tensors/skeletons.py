"""Building models without allocating their parameters (:func:`skeleton`).

The public face is :mod:`torchsurgery.tensors`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from torchsurgery._swap import wrap_like
from torchsurgery._validate import check_device

__all__ = ["skeleton"]

@contextlib.contextmanager
def skeleton(device: str | torch.device = "meta", include_buffers: bool = False) -> Iterator[None]:
    """Build models inside the block without allocating their parameters.

    Like ``with torch.device("meta")``, but buffers stay real by default: models often
    compute rotary tables or position ids in ``__init__``, and those are not in their
    checkpoints. Fill the model afterwards with :func:`load_`. Everything is put back on
    exit, also on an exception. The redirection applies to every thread while active.

    Args:
        device: where parameters are put (``"meta"``: nowhere).
        include_buffers: put buffers there too.

    Yields:
        Nothing.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> with torchsurgery.skeleton():
        ...     bn = nn.BatchNorm1d(4)
        >>> bn.weight.device.type, bn.running_mean.device.type
        ('meta', 'cpu')
    """
    target = check_device(device, "torchsurgery.skeleton") or torch.device("meta")
    original_param = nn.Module.register_parameter
    original_buffer = nn.Module.register_buffer

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original_param(self, name, param)
        if param is not None and param.device != target:
            self._parameters[name] = wrap_like(param, param.detach().to(target))  # type: ignore[assignment]

    def register_buffer(self: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        if tensor is not None and tensor.device != target:
            tensor = tensor.to(target)
        original_buffer(self, name, tensor, persistent=persistent)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    if include_buffers:
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original_param  # type: ignore[method-assign]
        nn.Module.register_buffer = original_buffer  # type: ignore[method-assign]
