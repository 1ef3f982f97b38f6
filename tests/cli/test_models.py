"""Resolving MODEL: directories, safetensors files, tiny architectures, and what cannot be loaded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from torchsurgery.cli.errors import CliError
from torchsurgery.cli.models import LoadedModel, load

transformers = pytest.importorskip("transformers")


def test_model_directory_and_safetensors_file_with_an_input_file(tmp_path: Path, cli: Callable[..., Any]) -> None:
    model = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=64))
    model.save_pretrained(tmp_path / "gpt2")
    inputs = tmp_path / "inputs.txt"
    inputs.write_text("first line\n\nsecond line\n", encoding="utf-8")
    listing = cli("inspect", str(tmp_path / "gpt2"), "--depth", "2")
    assert listing.returncode == 0, listing.stderr
    assert "h.0" in listing.stdout and "h.0.attn" not in listing.stdout  # --depth 2 stops there
    out = tmp_path / "t.safetensors"
    result = cli("trace", str(tmp_path / "gpt2" / "model.safetensors"), "--hook", "h.*", "--input-file", str(inputs),
                 "--out", str(out), "--max-length", "16")
    assert result.returncode == 0, result.stderr
    stored = load_file(out)
    assert stored["h.0"].shape == (2, 16, 32) and stored["attention_mask"].shape == (2, 16)
    # the file's captures equal a plain forward of the same weights on the same byte-level ids
    reference = transformers.GPT2Model.from_pretrained(tmp_path / "gpt2").eval()
    with torch.no_grad():
        hidden = reference(input_ids=stored["attention_mask"] * 0 + _bytes(["first line", "second line"], 16),
                           attention_mask=stored["attention_mask"], output_hidden_states=True).hidden_states
    torch.testing.assert_close(stored["h.0"], hidden[1], rtol=1e-4, atol=1e-4)  # (the last one has ln_f applied)


def _bytes(texts: list[str], length: int) -> torch.Tensor:
    ids = torch.zeros(len(texts), length, dtype=torch.long)
    for row, text in enumerate(texts):
        data = list(text.encode())[:length]
        ids[row, : len(data)] = torch.tensor(data)
    return ids


def test_a_safetensors_file_loads_the_same_weights_and_without_them_leaves_them_in_the_file(tmp_path: Path) -> None:
    model = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=64))
    model.save_pretrained(tmp_path)
    loaded = load(str(tmp_path / "model.safetensors"))
    assert loaded.name == "model" and loaded.checkpoint is None
    for (name, want), (_, got) in zip(model.state_dict().items(), loaded.model.state_dict().items(), strict=True):
        assert torch.equal(want, got), name
    empty = load(str(tmp_path), weights=False)
    assert empty.checkpoint == tmp_path
    assert all(p.is_meta for p in empty.model.parameters())
    assert not any(b.is_meta for b in empty.model.buffers())  # buffers are read; only parameters stay in the file


def test_tiny_models_feed_bytes_as_token_ids() -> None:
    loaded = load("tiny-gpt2")
    assert isinstance(loaded, LoadedModel) and loaded.tokenizer is None
    batch = loaded.encode(["ab", ""], max_length=4)
    assert batch["input_ids"].tolist() == [[97, 98, 0, 0], [0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]


def test_what_cannot_be_loaded_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    cases = [
        (str(tmp_path / "missing"), True, "no such model:"),
        (str(tmp_path / "empty"), True, "holds no config.json"),
        (str(tmp_path / "notes.txt"), True, "is not a model directory or a .safetensors file"),
        ("tiny-bert", False, "--storage streams weights from a file, and tiny-bert has none"),
    ]
    for spec, weights, message in cases:
        with pytest.raises(CliError, match=message):
            load(spec, weights=weights)
