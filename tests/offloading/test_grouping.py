"""Which modules form offload groups: repeated blocks, leaves, explicit names, modules never called."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _offload_models import identity_map, least_budget, mlp, tiny_llama
from torch import nn

import torchsurgery
from torchsurgery import offload
from torchsurgery.offloading.grouping import find_groups, repeated_blocks


def test_blocks_are_the_longest_run_of_same_typed_children() -> None:
    model = tiny_llama()
    container, blocks = repeated_blocks(model)
    assert container == "model.layers" and blocks == [f"model.layers.{i}" for i in range(3)]
    groups = find_groups(model, "blocks")
    assert groups[1:4] == blocks
    assert {"model.embed_tokens", "model.norm", "lm_head"} <= set(groups)
    # every parameter is covered exactly once by the groups
    covered = [n for n, _ in model.named_parameters() if any(n.startswith(f"{g}.") for g in groups)]
    assert sorted(covered) == sorted(n for n, _ in model.named_parameters())


def test_leaves_and_explicit_groups() -> None:
    model = mlp(2)
    assert find_groups(model, "leaves") == ["0", "1.0.0", "1.0.2", "1.1.0", "1.1.2", "2"]
    assert find_groups(model, ["2", "0"]) == ["0", "2"]
    with pytest.raises(ValueError, match="did you mean"):
        find_groups(model, ["1.0.00"])
    with pytest.raises(ValueError, match="overlap"):
        find_groups(model, ["1", "1.0"])
    with pytest.raises(ValueError, match="blocks"):
        find_groups(model, "everything")


class _Experts(nn.Module):
    """A container without a forward of its own: its owner calls its children and reads ``gate``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(d))
        self.up = nn.Linear(d, d)
        self.down = nn.Linear(d, d)


class _UncalledContainers(nn.Module):
    """Blocks, plus weights held by modules whose own forward never runs."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.heads = nn.ModuleList([nn.LayerNorm(d), nn.Linear(d, d)])
        self.extra = nn.ModuleDict({"a": nn.Linear(d, d), "b": nn.Linear(d, d)})
        self.experts = _Experts(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x).relu()
        x = self.heads[1](self.heads[0](x))
        x = self.extra["a"](x) + self.extra["b"](x)
        return self.experts.down(self.experts.up(x) * self.experts.gate)


@pytest.mark.parametrize("groups", ["blocks", "leaves"])
def test_default_groups_split_modules_that_are_never_called(groups: str) -> None:
    model = _UncalledContainers()
    found = find_groups(model, groups)
    named = dict(model.named_modules())
    assert not any(type(named[g]).forward is nn.Module.forward for g in found if g)
    assert "" in found  # experts.gate is read by the root's forward, so the root's group holds it
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
        with offload(model, storage_dtype=torch.float64, dtype=torch.float32, groups=groups):
            got = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


class _PatchEmbed(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


class _BypassedForward(nn.Module):
    """Calls a part of a piece that has a forward of its own (``self.embed.proj(x)``)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.embed = _PatchEmbed(d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed.proj(x)
        for block in self.blocks:
            x = block(x).relu()
        return self.embed.norm(x)


@pytest.mark.accelerator
def test_default_groups_bring_in_parts_called_without_their_owner(accelerator: torch.device) -> None:
    model = _BypassedForward()
    assert {"embed.proj", "embed.norm"} <= set(find_groups(model, "blocks"))
    x = torch.randn(2, 8, device=accelerator)
    # streamed groups are stored fp64 and brought in as fp32: a weight left out fails the matmul
    with torch.no_grad():
        expected = copy.deepcopy(model).to(accelerator)(x)
        options: dict[str, Any] = {"storage_dtype": torch.float64, "dtype": torch.float32, "prefetch": 1}
        with offload(model, accelerator, budget=least_budget(model, accelerator, **options), **options) as handle:
            assert {"embed.proj", "embed.norm"} <= set(handle.stats().streamed_groups)
            got = model(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_an_explicit_group_that_is_never_called_is_refused_with_its_children() -> None:
    model = _UncalledContainers()
    before = identity_map(model)
    with pytest.raises(ValueError, match=r"'extra' is a ModuleDict.*\['extra.a', 'extra.b'\]"):
        offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, groups=["blocks.0", "extra"])
    assert identity_map(model) == before and not torchsurgery.surgery_log(model)


class _Pooling(nn.Module):
    """Attention pooling as SigLIP's head does it: a probe attends over the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.attention(x[:, :1], x, x)[0]


def test_a_module_reading_its_childrens_weights_is_one_group_with_them(tmp_path: Any) -> None:
    """nn.MultiheadAttention reads ``out_proj.weight`` without calling ``out_proj``: streamed from a
    file, a group of its own would leave that weight ``meta`` when the attention runs. (The
    "blocks" groups outside the blocks: SigLIP's head in tests/compat/test_framepack_streamed.py.)"""
    groups = "leaves"
    from safetensors.torch import save_file

    model = nn.Sequential(nn.Linear(8, 8), _Pooling()).eval()
    found = find_groups(model, groups)
    holding = [g for g in found if "1.attention.out_proj".startswith(f"{g}.")]
    assert holding == ["1.attention"] and "1.attention.out_proj" not in found
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        expected = model(x)
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    with torchsurgery.skeleton():
        streamed = nn.Sequential(nn.Linear(8, 8), _Pooling()).eval()
    with offload(streamed, storage=tmp_path / "model.safetensors", groups=groups), torch.no_grad():
        # (the attention's fused path may be taken for one and not the other: the last bits differ)
        torch.testing.assert_close(streamed(x), expected, rtol=1e-6, atol=1e-6)
