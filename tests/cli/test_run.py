"""``torchsurgery run``: its figures against plain PyTorch, for each option."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

import torchsurgery
from torchsurgery.offloading import stored_values

pytest.importorskip("transformers")


def _reference(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.Tensor]:
    from torchsurgery.cli.models import LoadedModel, _tiny

    model = _tiny("tiny-llama").eval().to(dtype)
    inputs = LoadedModel("tiny-llama", model, None).encode(["Surgery on a live model."], max_length=64)
    with torch.no_grad():
        return model, model(**inputs).last_hidden_state


def _run(call: Callable[..., Any], *args: str) -> dict[str, Any]:
    result = call("run", "tiny-llama", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_plain_run_is_the_model(call: Callable[..., Any]) -> None:
    document = _run(call)
    model, expected = _reference()
    assert document["device"] == "cpu" and document["dtype"] == "float32" and document["offload"] is None
    assert document["output"]["shape"] == list(expected.shape)
    assert document["output"]["norm"] == pytest.approx(float(expected.norm()), rel=1e-6)
    plain = document["plain"]
    assert plain["held_bytes"] == plain["resident_bytes"] == plain["peak_bytes"] == _bytes(model)
    assert plain["streamed_bytes"] == plain["moved_bytes"] == 0 and isinstance(plain["seconds"], float)


def test_storage_dtype_streams_blocks_in_bf16(call: Callable[..., Any]) -> None:
    document = _run(call, "--storage-dtype", "bf16", "--device", "cpu")
    model, expected = _reference()
    with torchsurgery.offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32) as handle:
        narrow = sum(p.numel() * 2 for p in model.parameters() if stored_values(p).dtype == torch.bfloat16)
        kept = sum(p.numel() * 4 for p in model.parameters() if stored_values(p).dtype == torch.float32)  # norms, embeddings
        groups = handle.stats().streamed_groups
    offloaded = document["offload"]
    assert offloaded["storage_dtype"] == "bfloat16" and offloaded["groups"] == "blocks" and offloaded["prefetch"] == 1
    assert narrow > 0 and kept > 0
    assert offloaded["streamed_bytes"] == narrow and offloaded["resident_bytes"] == kept
    assert offloaded["held_bytes"] == narrow + kept < _bytes(model)
    assert offloaded["moved_bytes"] == narrow  # every narrow weight is cast once per forward
    assert kept < offloaded["peak_bytes"] < kept + narrow  # the casts are not all held at once
    assert offloaded["streamed_groups"] == groups == ["embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3",
                                                      "norm"]
    assert 0 < offloaded["max_abs_diff"] < 0.05 * float(expected.abs().max())


def test_in_memory_on_a_cpu_nothing_is_streamed(call: Callable[..., Any]) -> None:
    # weights already in host memory in the compute dtype: ready where the computation runs
    offloaded = _run(call, "--offload")["offload"]
    model, _ = _reference()
    assert offloaded["resident_bytes"] == offloaded["held_bytes"] == offloaded["peak_bytes"] == _bytes(model)
    assert offloaded["streamed_bytes"] == offloaded["moved_bytes"] == 0 and offloaded["max_abs_diff"] == 0.0


def test_budget_that_holds_the_model_keeps_it_resident(call: Callable[..., Any]) -> None:
    offloaded = _run(call, "--budget", "10MB")["offload"]
    model, _ = _reference()
    assert offloaded["budget_bytes"] == 10**7
    assert offloaded["resident_bytes"] == offloaded["held_bytes"] == _bytes(model)
    assert offloaded["streamed_bytes"] == offloaded["moved_bytes"] == 0 and offloaded["streamed_groups"] == []
    assert len(offloaded["resident_groups"]) == 6 and offloaded["max_abs_diff"] == 0.0


def test_dtype_computes_in_bf16(call: Callable[..., Any]) -> None:
    document = _run(call, "--dtype", "bf16", "--offload")
    model, expected = _reference(torch.bfloat16)
    assert document["dtype"] == "bfloat16" and document["plain"]["held_bytes"] == _bytes(model)
    assert document["output"]["norm"] == pytest.approx(float(expected.float().norm()), rel=1e-3)
    assert document["offload"]["max_abs_diff"] == 0.0  # bf16 weights used as they are


def test_groups_and_prefetch(call: Callable[..., Any]) -> None:
    leaves = _run(call, "--groups", "leaves", "--storage-dtype", "fp16", "--prefetch", "2")["offload"]
    model, _ = _reference()
    assert leaves["groups"] == "leaves" and leaves["prefetch"] == 2
    assert leaves["streamed_groups"] == [n for n, m in model.named_modules() if list(m.parameters(recurse=False))]
    chosen = _run(call, "--groups", "layers.*,norm", "--storage-dtype", "bf16")["offload"]
    assert chosen["streamed_groups"] == ["layers.0", "layers.1", "layers.2", "layers.3", "norm"]
    assert chosen["groups"] == "layers.*,norm"


@pytest.mark.accelerator
def test_on_an_accelerator(call: Callable[..., Any], accelerator: torch.device) -> None:
    # above the least budget streaming takes (the ring's two slots, a run's casts, the buffers)
    document = _run(call, "--device", accelerator.type, "--storage-dtype", "bf16", "--budget", "320KB")
    assert document["device"] == accelerator.type
    offloaded = document["offload"]
    assert offloaded["moved_bytes"] > 0 and offloaded["peak_bytes"] <= 320_000 + 3 * 150_000
    assert offloaded["max_abs_diff"] < 0.05


def test_run_with_offload_reports_both_runs(cli: Callable[..., Any]) -> None:
    result = cli("run", "tiny-llama", "--offload", "--storage-dtype", "bf16")
    assert result.returncode == 0, result.stderr
    assert "plain" in result.stdout and "offload" in result.stdout and "streamed" in result.stdout
