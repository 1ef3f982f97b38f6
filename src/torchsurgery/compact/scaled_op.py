"""The scaled product as one operator: what a compiled graph calls for a scaled weight's product.

A compiled forward by an ``nn.Linear`` whose weight is stored with a scale
(:mod:`torchsurgery.compact.scaled`) multiplies by ``q`` and scales the sums, as the eager
forward does, through :func:`scaled_product_op`.
"""

from __future__ import annotations

import torch

from torchsurgery.compact.narrow import narrow_product
from torchsurgery.compact.scaled import scaled_product

__all__ = ["scaled_product_op"]


@torch.library.custom_op("torchsurgery::scaled_product", mutates_args=())
def scaled_product_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (q * scale[:, None]).T + bias`` by :func:`~torchsurgery.compact.scaled.scaled_product` as one
    operator: a compiled forward computes what the eager one does, the same kernels in the same order.

    Example:
        >>> import torch
        >>> q = torch.tensor([[2, 4]], dtype=torch.int8)
        >>> scaled_product_op(torch.ones(1, 2), q, torch.tensor([0.5]), None).tolist()
        [[3.0]]
    """
    return scaled_product(x, q, scale[:, None].expand(q.shape), bias, _sums)


@scaled_product_op.register_fake
def _scaled_product_shape(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], q.shape[0]))


def _sums(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    # a scaled product's sums: the narrow product of q itself, scaled, as eager takes them
    return narrow_product(x, q, bias, False, None, scale=scale)
