"""``torchsurgery trace`` with the library's options: each against a plain trace of the same model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

TEXTS = ["first input", "a second, longer input text", "third"]
LAYERS = [f"encoder.layer.{i}" for i in range(3)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small BERT saved as a transformers directory (config.json + model.safetensors)."""
    folder = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                     vocab_size=256, max_position_embeddings=64)
    transformers.BertModel(config).save_pretrained(folder)
    return folder


def _trace(call: Callable[..., Any], model: Path | str, out: Path, *args: str) -> dict[str, Any]:
    texts = [a for t in TEXTS for a in ("--text", t)]
    result = call("trace", str(model), "--hook", "encoder.layer.*", *texts, "--out", str(out), "--batch-size", "2",
                  "--max-length", "16", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def plain(saved: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    from torchsurgery.cli import main

    out = tmp_path_factory.mktemp("plain") / "plain.safetensors"
    texts = [a for t in TEXTS for a in ("--text", t)]
    main(["trace", str(saved), "--hook", "encoder.layer.*", *texts, "--out", str(out), "--batch-size", "2",
          "--max-length", "16"])
    return load_file(out)


def test_json_describes_the_file(call: Callable[..., Any], saved: Path, tmp_path: Path,
                                 plain: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "t.safetensors"
    document = _trace(call, saved, out)
    stored = load_file(out)
    assert document["command"] == "trace" and document["out"] == str(out) and document["inputs"] == len(TEXTS)
    assert document["device"] == "cpu" and document["dtype"] == "float32" and document["offload"] is None
    assert [c["module"] for c in document["captures"]] == LAYERS
    mask = stored["attention_mask"].bool()
    for capture in document["captures"]:
        tensor = stored[capture["module"]]
        assert capture["shape"] == list(tensor.shape) and capture["dtype"] == "float32"
        rows = tensor[mask]
        assert capture["mean"] == pytest.approx(float(rows.mean()), abs=1e-5)
        assert capture["std"] == pytest.approx(float(rows.std(unbiased=False)), rel=1e-4)
        assert capture["token_norm"] == pytest.approx(float(rows.norm(dim=-1).mean()), rel=1e-4)
        assert torch.equal(tensor, plain[capture["module"]])


def _weight_bytes(saved: Path) -> int:
    reference = transformers.BertModel.from_pretrained(saved)
    return sum(p.numel() * p.element_size() for p in reference.parameters())


def _captures_match(out: Path, plain: dict[str, torch.Tensor], tol: float) -> None:
    """Every hooked layer's capture in ``out`` equals the plain trace's (within ``tol``)."""
    stored = load_file(out)
    for key in LAYERS:
        torch.testing.assert_close(stored[key], plain[key], rtol=tol, atol=tol)


@pytest.mark.parametrize("source", ["folder", "file"])
def test_storage_streams_every_group_from_the_file(
    call: Callable[..., Any], saved: Path, tmp_path: Path, plain: dict[str, torch.Tensor], source: str
) -> None:
    model = saved if source == "folder" else saved / "model.safetensors"
    out = tmp_path / "t.safetensors"
    document = _trace(call, model, out, "--storage")
    offloaded = document["offload"]
    total = _weight_bytes(saved)
    assert offloaded["streamed_from"] == str(model) and offloaded["held_bytes"] == 0  # nothing held in memory
    assert offloaded["resident_bytes"] == 0 and offloaded["streamed_bytes"] == total
    assert offloaded["moved_bytes"] == total * 2  # every group read once per batch (2 batches)
    _captures_match(out, plain, tol=0.0)


def test_storage_with_a_budget_that_holds_the_model(call: Callable[..., Any], saved: Path, tmp_path: Path,
                                                    plain: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "t.safetensors"
    offloaded = _trace(call, saved, out, "--storage", "--budget", "10MB")["offload"]
    total = _weight_bytes(saved)
    assert offloaded["resident_bytes"] == total and offloaded["streamed_bytes"] == 0  # read from the file once
    _captures_match(out, plain, tol=0.0)


def test_storage_with_a_compute_dtype(call: Callable[..., Any], saved: Path, tmp_path: Path,
                                      plain: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "t.safetensors"
    document = _trace(call, saved / "model.safetensors", out, "--storage", "--dtype", "bf16")
    assert document["dtype"] == "bfloat16" and {c["dtype"] for c in document["captures"]} == {"bfloat16"}
    stored = load_file(out)
    for key in LAYERS:
        assert stored[key].dtype == torch.bfloat16
        torch.testing.assert_close(stored[key].float(), plain[key], rtol=0.05, atol=0.1)


def test_offload_options_keep_the_captures(call: Callable[..., Any], saved: Path, tmp_path: Path,
                                           plain: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "t.safetensors"
    document = _trace(call, saved, out, "--storage-dtype", "bf16", "--groups", "leaves", "--prefetch", "2")
    offloaded = document["offload"]
    assert offloaded["storage_dtype"] == "bfloat16" and offloaded["groups"] == "leaves" and offloaded["prefetch"] == 2
    assert offloaded["streamed_from"] == "memory" and offloaded["moved_bytes"] > 0
    _captures_match(out, plain, tol=0.05)


def test_budget_that_holds_the_model_changes_nothing(call: Callable[..., Any], saved: Path, tmp_path: Path,
                                                     plain: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "t.safetensors"
    offloaded = _trace(call, saved, out, "--budget", "10MB", "--offload")["offload"]
    assert offloaded["budget_bytes"] == 10**7 and offloaded["moved_bytes"] == 0 and offloaded["streamed_bytes"] == 0
    stored = load_file(out)
    for key in LAYERS:
        assert torch.equal(stored[key], plain[key])


def test_dtype_without_offload(call: Callable[..., Any], saved: Path, tmp_path: Path,
                               plain: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "t.safetensors"
    document = _trace(call, saved, out, "--dtype", "fp16", "--device", "cpu")
    assert document["dtype"] == "float16" and document["offload"] is None
    stored = load_file(out)
    for key in LAYERS:
        assert stored[key].dtype == torch.float16
        torch.testing.assert_close(stored[key].float(), plain[key], rtol=0.02, atol=0.02)
