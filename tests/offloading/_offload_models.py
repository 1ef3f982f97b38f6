"""Small models and checks shared by the offloading tests."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import torchsurgery
from torchsurgery._device import OffloadDevice
from torchsurgery.offloading import DEFAULT_SKIP

transformers = pytest.importorskip("transformers")


def mlp(blocks: int = 4, d: int = 32) -> nn.Module:
    layers = [nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(blocks)]
    return nn.Sequential(nn.LayerNorm(d), nn.Sequential(*layers), nn.Linear(d, 4))


def tiny_gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    ).eval()


def tiny_llama() -> nn.Module:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    ).eval()


def tiny_clip_text() -> nn.Module:
    return transformers.CLIPTextModel(
        transformers.CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                    vocab_size=64, max_position_embeddings=32, attn_implementation="eager")
    ).eval()


def least_budget(model: nn.Module, device: str | torch.device | OffloadDevice = "cpu", **options: Any) -> int:
    """The least budget ``offload(model, device, **options)`` accepts (``BudgetError.needed``): with
    nothing resident, what streaming holds at once (the ring's slots, a run's casts, the
    buffers), or the model whole where that is less."""
    with pytest.raises(torchsurgery.BudgetError) as refused:
        torchsurgery.plan_offload(model, device, budget=1, **options)
    return refused.value.needed


def rounded_reference(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A plain copy of ``model`` whose weights hold what an offload stores them as (norms and embeddings keep theirs)."""
    reference = copy.deepcopy(model)
    kept = {id(p) for name, m in reference.named_modules() if DEFAULT_SKIP(m, name) for p in m.parameters(recurse=False)}
    with torch.no_grad():
        for p in reference.parameters():
            if id(p) not in kept:
                p.copy_(p.to(dtype))
    return reference


def identity_map(model: nn.Module) -> dict[str, tuple[int, torch.device, torch.dtype]]:
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    return {n: (id(t), t.device, t.dtype) for n, t in named}


IDS = torch.tensor([[3, 7, 1, 9]])


def peak_of(run: Callable[[], Any]) -> int:
    """Device bytes allocated at the peak of ``run()`` above what was allocated before it."""
    torch.accelerator.synchronize()
    torch.accelerator.reset_peak_memory_stats()
    before = torch.accelerator.memory_allocated()
    run()
    torch.accelerator.synchronize()
    return torch.accelerator.max_memory_allocated() - before
