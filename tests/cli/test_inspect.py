"""``torchsurgery inspect``: every module with its sizes, dtypes, devices and surgery."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from torchsurgery.cli.errors import CliError
from torchsurgery.cli.inspect import module_rows

transformers = pytest.importorskip("transformers")


def test_inspect_shows_surgery_and_hooks() -> None:
    import torchsurgery

    class Tag(torchsurgery.Patch, nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    torchsurgery.patch(model[0], Tag)
    model[1].register_forward_hook(lambda m, a, o: None)
    rows = {r["name"]: r["surgery"] for r in module_rows(model, None, None)}
    assert rows == {"": [], "0": [f"patch {Tag.__qualname__}"], "1": ["1 hook"]}


def test_inspect_prints_every_module(cli: Callable[..., Any]) -> None:
    result = cli("inspect", "tiny-gpt2")
    assert result.returncode == 0, result.stderr
    model = transformers.GPT2Model(transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=128))
    for name, module in model.named_modules():
        assert (name.rsplit(".", 1)[-1] if name else "<root>") in result.stdout
        assert type(module).__name__ in result.stdout
    filtered = cli("inspect", "tiny-gpt2", "--filter", "h.*.mlp")
    assert filtered.returncode == 0 and "h.0.mlp" in filtered.stdout and "wte" not in filtered.stdout


def test_rows_count_what_the_modules_hold() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 2).to(torch.float16)))
    rows = {r["name"]: r for r in module_rows(model, None, None)}
    assert list(rows) == [name for name, _ in model.named_modules()]
    for name, module in model.named_modules():
        tensors = list(module.parameters()) + list(module.buffers())
        assert rows[name]["params"] == sum(p.numel() for p in module.parameters())
        assert rows[name]["bytes"] == sum(t.numel() * t.element_size() for t in tensors)
        assert rows[name]["type"] == type(module).__name__
        assert rows[name]["level"] == (name.count(".") + 1 if name else 0)
    assert rows[""]["dtypes"] == ["float16", "float32", "int64"]  # (BatchNorm counts its batches in int64)
    assert rows["1.1"]["dtypes"] == ["float16"] and rows["1.1"]["where"] == ["cpu"]


def test_depth_and_filter_select_rows() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert [r["name"] for r in module_rows(model, 1, None)] == ["", "0", "1"]
    assert [r["name"] for r in module_rows(model, 0, None)] == [""]
    assert [r["name"] for r in module_rows(model, None, "1.*")] == ["1.0", "1.1"]
    with pytest.raises(CliError, match=r"--filter: '2\.\*' matches no submodule of the model"):
        module_rows(model, None, "2.*")


def test_a_model_file_cut_short_is_one_error_line(cli: Callable[..., Any], tmp_path: Any) -> None:
    import os

    config = transformers.BertConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     vocab_size=64, max_position_embeddings=16)
    transformers.BertModel(config).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    result = cli("inspect", str(tmp_path))
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot load a model from {tmp_path}:")
