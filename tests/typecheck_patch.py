"""Checked by mypy in `make test` (seed requirement 7): type checkers see a patch's additions.

`from_existing` returns the patch type, so attributes the patch declares are known to the
checker and calling methods of the original class still type-checks.
"""

from __future__ import annotations

from typing import assert_type

import torch
from torch import nn

import torchsurgery


class WithDelta(torchsurgery.Patch, nn.Embedding):
    delta: nn.Parameter

    def __patch_init__(self, rows: int) -> None:
        self.delta = nn.Parameter(torch.zeros(rows, self.embedding_dim))


emb = WithDelta.from_existing(nn.Embedding(4, 2), 3)
assert_type(emb, WithDelta)
delta: nn.Parameter = emb.delta
dim: int = emb.embedding_dim
same: nn.Embedding = torchsurgery.patch(nn.Embedding(3, 2), WithDelta, 1)
