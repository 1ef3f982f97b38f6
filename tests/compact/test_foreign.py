"""Weights quantised by torchao (a tensor subclass of its own) under an offload with a ``storage_dtype``.

``quantize_(model, Int8WeightOnlyConfig())`` then ``offload(model, storage_dtype=...)``: the
torchao weights are kept as they are (the same objects, their own values and products), the
others are stored as asked. The reference is the torchao-quantised model whose other weights
hold the values the offload stores (rounded, or dequantised from a scaled format).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from _weight_kinds import dequantised
from torch import nn

import torchsurgery
from torchsurgery.compact import OffloadedTensor, Scaled


@pytest.fixture(scope="module")
def torchao() -> object:
    logging.getLogger("torchao").setLevel(logging.ERROR)  # its CUDA kernels, not built for this machine
    return pytest.importorskip("torchao")


@pytest.mark.parametrize("storage", [torch.bfloat16, Scaled(torch.float8_e4m3fn)], ids=["bf16", "fp8-scaled"])
def test_torchao_weights_are_kept_as_they_are_and_the_rest_stored_as_asked(torchao: object, storage: torch.dtype | Scaled) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda module, name: name == "0")
    quantised = model[0].weight
    x = torch.randn(2, 16)
    reference = copy.deepcopy(model)

    handle = torchsurgery.offload(model, storage_dtype=storage, dtype=torch.float32)
    assert model[0].weight is quantised and type(quantised).__module__.startswith("torchao")
    assert isinstance(model[2].weight, OffloadedTensor)  # the plain layer is stored as asked
    with torch.no_grad():
        for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
            if name != "0.weight":
                p.copy_(dequantised(q))
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(model(x), reference(x), msg=lambda m, g=grad: f"grad={g}: {m}")

    handle.remove()
    assert model[0].weight is quantised and type(model[2].weight) is nn.Parameter
    # the stored values come back (narrow storage rounds), the torchao weight as it was
    torch.testing.assert_close(model(x), reference(x))
