"""A short tour of class patching on a real embedding layer (run by `make demo`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import torchsurgery


class MostlyFrozenEmbedding(torchsurgery.Patch, nn.Embedding):
    """Learn a correction for a few token embeddings; the rest stays frozen."""

    def __patch_init__(self, trainable_token_ids: list[int]) -> None:
        self.weight.requires_grad_(False)
        self.register_buffer("token_ids", torch.tensor(trainable_token_ids))
        self.delta = nn.Parameter(torch.zeros(len(trainable_token_ids), self.embedding_dim))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight.index_add(0, self.token_ids, self.delta)
        return F.embedding(input, weight, self.padding_idx)


def main() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(16, 8)
    frozen = emb.weight.detach().clone()
    MostlyFrozenEmbedding.from_existing(emb, trainable_token_ids=[1, 2])
    print(f"patched: {type(emb).__name__}, stack {torchsurgery.patches(emb)}")
    opt = torch.optim.SGD([p for p in emb.parameters() if p.requires_grad], lr=0.5)
    tokens, target = torch.tensor([1, 2, 3]), torch.ones(3, 8)
    for step in range(5):
        loss = F.mse_loss(emb(tokens), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}")
    assert torch.equal(emb.weight, frozen), "the frozen weight must not move"
    torchsurgery.unpatch(emb)
    print(f"unpatched: {type(emb).__name__}, state_dict keys {sorted(emb.state_dict())}")


if __name__ == "__main__":
    main()
