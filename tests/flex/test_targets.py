"""What hook names bind to: globs, near-name suggestions, names through DataParallel and
torch.compile wrappers."""

from __future__ import annotations

import sys

import pytest
import torch
from _flex_models import IDS, tiny_gpt2
from torch import nn

from torchsurgery import FlexModel, HookFunction


def test_glob_expands_and_unknown_names_suggest() -> None:
    model = tiny_gpt2(layers=3)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_forward_hook(HookFunction("transformer.h.*.mlp"))
    flex(IDS)
    assert sorted(out) == [f"transformer.h.{i}.mlp" for i in range(3)]
    with pytest.raises(ValueError, match="did you mean 'transformer.h.0.mlp'"):
        flex.register_forward_hook(HookFunction("transformer.h.0.mlpp"))
    with pytest.raises(ValueError, match="matches no submodule"):
        flex.register_forward_hook(HookFunction("decoder.*.mlp"))
    flex.restore()


@pytest.mark.parametrize("wrap", ["DataParallel", "compile"])
def test_wrapped_model_hooks_accept_both_name_forms(wrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # DataParallel scatters through CUDA's collectives only: it wraps the model on the host
    # here, as on a machine without GPUs
    monkeypatch.setattr(sys.modules["torch.nn.parallel.data_parallel"], "_get_available_device_type", lambda: None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(2, 3)
    reference = model[0](x).detach()
    wrapped = nn.DataParallel(model) if wrap == "DataParallel" else torch.compile(model, backend="eager")
    prefix = "module." if wrap == "DataParallel" else "_orig_mod."
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(wrapped, out)
    flex.register_forward_hook(HookFunction("0"))
    flex.register_forward_hook(HookFunction(prefix + "0"))  # flex_model's users name it so
    flex.register_hook(HookFunction(prefix + "2.bias"))
    flex(x).sum().backward()
    assert sorted(out) == sorted(["0", prefix + "0", prefix + "2.bias"])
    torch.testing.assert_close(out["0"][0], reference)
    torch.testing.assert_close(out[prefix + "0"][0], reference)
    torch.testing.assert_close(out[prefix + "2.bias"][0], torch.ones(2) * 2)
    with pytest.raises(ValueError, match="matches no submodule"):
        flex.register_forward_hook(HookFunction(prefix + "9"))
    torch.testing.assert_close(flex.get_module_parameter(prefix + "0.weight"), model[0].weight.detach())
    flex.restore()


def test_parameter_names_are_exact_or_globs() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_hook(HookFunction("*.bias"))
    flex.register_hook(HookFunction("1.weight"))
    model_out = flex(torch.ones(3, 2)).sum()
    model_out.backward()
    assert sorted(out) == ["0.bias", "1.bias", "1.weight"]
    torch.testing.assert_close(out["1.bias"][0], torch.tensor([3.0]))
    with pytest.raises(ValueError, match="did you mean '1.weight'"):
        flex.register_hook(HookFunction("1.weigth"))
    flex.restore()
