"""Tiny transformers models and helpers the flex tests share."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")


def tiny_gpt2(layers: int = 2) -> nn.Module:
    config = transformers.GPT2Config(n_layer=layers, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    return transformers.GPT2LMHeadModel(config).eval()


def tiny_opt() -> nn.Module:
    config = transformers.OPTConfig(
        hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2, vocab_size=64,
        max_position_embeddings=32, word_embed_proj_dim=16,
    )
    return transformers.OPTForCausalLM(config).eval()


def tiny_llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config).eval()


IDS = torch.tensor([[1, 5, 9, 3, 7]])


def pristine(model: nn.Module) -> dict[str, Any]:
    return {
        name: (
            type(m),
            sorted(m.__dict__),
            {k: id(p) for k, p in m._parameters.items()},
            len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks),
        )
        for name, m in model.named_modules()
    } | {"param_hooks": [len(p._backward_hooks or {}) for p in model.parameters()]}


def double(module: nn.Module, x: torch.Tensor, ctx: Any, modules: nn.ModuleDict) -> torch.Tensor:
    return x * 2

