"""The words for sizes: read from the weights, the same whatever the engine calls its groups."""

from __future__ import annotations

import torch
from torch import nn

import torchsurgery
from torchsurgery.cli.figures import figures

CPU = torch.device("cpu")


def _model() -> nn.Module:
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))


def _size(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_plain_model_is_all_resident() -> None:
    model = _model()
    total = _size(list(model.parameters()))
    assert figures(model, CPU, torch.float32) == {"held_bytes": total, "resident_bytes": total, "streamed_bytes": 0,
                                                  "moved_bytes": 0, "peak_bytes": total}
    # computing in another dtype: nothing is ready as it is
    assert figures(model, CPU, torch.bfloat16)["resident_bytes"] == 0


def test_a_narrow_storage_dtype_streams_what_it_narrows() -> None:
    model = _model()
    kept = _size([model[0].weight, *model[2].parameters()])  # embedding and norm keep their dtype
    linears = [p for i in (1, 3) for p in model[i].parameters()]
    with torchsurgery.offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, groups="leaves") as handle:
        model(torch.tensor([[1, 2, 3]]))
        stats = handle.stats()
        result = figures(model, CPU, torch.float32, stats, stats.bytes_moved)
    assert result["resident_bytes"] == kept
    assert result["streamed_bytes"] == _size(linears) // 2  # stored in bf16
    assert result["moved_bytes"] == stats.bytes_moved and 0 < stats.bytes_moved <= result["streamed_bytes"]
    assert result["held_bytes"] == kept + result["streamed_bytes"]
    assert kept < result["peak_bytes"] <= kept + result["streamed_bytes"]


def test_weights_left_in_a_file_are_streamed_not_held() -> None:
    with torchsurgery.skeleton():
        model = _model()
    result = figures(model, CPU, torch.float32)
    assert result["held_bytes"] == result["resident_bytes"] == 0
    assert result["streamed_bytes"] == sum(p.numel() * 4 for p in model.parameters())


def test_another_accelerator_index_is_not_resident() -> None:
    model = nn.Linear(2, 2)
    assert figures(model, torch.device("cuda", 1), torch.float32)["resident_bytes"] == 0
