"""Weights that are another library's tensor subclass (torchao's quantised weights), kept as they are.

``torchao.quantization.quantize_`` replaces a layer's weight by a tensor subclass of its own
(``Int8Tensor``, float8 tensors...) holding its quantised values and computing its own
products. Such a weight is already compact: converting it to a ``storage_dtype`` would ask
the subclass for operators it does not implement (``aten.abs``, ``aten.t``). An offload keeps
it as it is, in its own dtype (no storage conversion, no compute-dtype conversion) and moves
or streams it whole, as it moves a plain weight; the rest of the model is offloaded as asked.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["foreign_subclass"]


def foreign_subclass(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a tensor subclass of another library that computes its own operators
    (a wrapper subclass, as torchao's quantised weights are), not torchsurgery's own weight.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> foreign_subclass(nn.Parameter(torch.ones(2))), foreign_subclass(torch.ones(2))
        (False, False)
    """
    from torchsurgery.compact.tensor import OffloadedTensor

    return is_traceable_wrapper_subclass(tensor) and not isinstance(tensor, OffloadedTensor)
