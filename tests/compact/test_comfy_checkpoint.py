"""Tests of ComfyUI's scaled fp8 checkpoints ("fp8 scaled") under ``load_`` and ``offload(storage=)``.

A test writes such a file as ComfyUI's tools do (each Linear weight in float8 with a
per-tensor ``scale_weight``, some with a ``scale_input``, a ``scaled_fp8`` marker, biases
in bf16, norms and embeddings unscaled). The reference throughout is the plain model
loaded by plain PyTorch with the values the file stands for, ``weight.float() * scale_weight``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import torchsurgery
from torchsurgery import load_, offload
from torchsurgery.compact import Scaled

CONFIG = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False,
)
TOKENS = torch.tensor([[1, 5, 9, 33, 2, 63, 17]])


def llama() -> LlamaForCausalLM:
    """A tiny Llama with random weights at a typical scale (std 0.02, where unscaled fp8 is subnormal)."""
    return LlamaForCausalLM(CONFIG).eval()


# "fp8 scaled": a scale_weight per weight and a scaled_fp8 marker for the file; "comfy_quant": the
# layers ComfyUI's quantisation ops load (comfy/quant_ops.py), a weight_scale and an input_scale
# per weight and a JSON marker per layer naming the format
_LAYOUT_KEYS = {"fp8 scaled": ("scale_weight", "scale_input"), "comfy_quant": ("weight_scale", "input_scale")}


def _comfy_quant_marker(fmt: str) -> torch.Tensor:
    return torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)


def write_comfy(
    model: nn.Module, path: Path, fp8: torch.dtype = torch.float8_e4m3fn, scale_shape: Any = (1,), layout: str = "fp8 scaled"
) -> dict[str, torch.Tensor]:
    """``model`` saved in one of ComfyUI's scaled fp8 layouts; returns what was written."""
    scale_key, input_key = _LAYOUT_KEYS[layout]
    state: dict[str, torch.Tensor] = {}
    for i, (name, layer) in enumerate((n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)):
        weight = layer.weight.detach()
        scale = weight.abs().amax().float() / torch.finfo(fp8).max
        state[f"{name}.weight"] = (weight / scale).to(fp8)
        state[f"{name}.{scale_key}"] = scale.reshape(scale_shape)
        if i % 2:
            state[f"{name}.{input_key}"] = torch.ones(())  # the activations' scale of fp8 matmuls: not needed
        if layout == "comfy_quant":
            state[f"{name}.comfy_quant"] = _comfy_quant_marker(str(fp8).removeprefix("torch."))
        if layer.bias is not None:
            state[f"{name}.bias"] = layer.bias.detach().to(torch.bfloat16)
    for key, value in model.state_dict().items():
        state.setdefault(key, value.contiguous())  # norms and embeddings unscaled, in fp32
    if layout == "fp8 scaled":
        state["scaled_fp8"] = torch.empty(0, dtype=fp8)  # ComfyUI's marker
    save_file(state, path)
    return state


def dequantised(state: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """The plain model holding the values ``state`` stands for, loaded by plain PyTorch
    (ComfyUI's dequantisation: the stored values in the compute dtype, times the scale)."""
    values = {}
    for key, value in state.items():
        prefix = key.removesuffix("weight")
        scale = state.get(prefix + "scale_weight", state.get(prefix + "weight_scale")) if key.endswith("weight") else None
        values[key] = value.float() * scale if scale is not None else value.float()
    reference = llama()
    reference.load_state_dict({k: v for k, v in values.items() if k in reference.state_dict()})
    return reference


def outputs(model: nn.Module, device: Any = "cpu") -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(TOKENS.to(device)).logits
    return logits


def same_state(model: nn.Module, reference: nn.Module) -> None:
    theirs = reference.state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, theirs[key], rtol=0, atol=0, msg=key)


def scale_of(weight: torch.Tensor) -> torch.Tensor:
    scale: torch.Tensor = weight.__dict__["_torchsurgery_scale"]
    return scale


@pytest.fixture
def comfy(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path / "model_fp8_scaled.safetensors"
    return path, write_comfy(llama(), path)


# ---------------------------------------------------------------------- load_


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scale_shape", [(), (1,)], ids=["scalar", "one"])
def test_a_plain_model_gets_the_dequantised_values_and_restore_gives_its_own_back(
    tmp_path: Path, fp8: torch.dtype, scale_shape: Any
) -> None:
    path = tmp_path / "m.safetensors"
    reference = dequantised(write_comfy(llama(), path, fp8, scale_shape))
    model = llama()
    before = copy.deepcopy(model)
    ids = [id(p) for p in model.parameters()]
    # the scales, input scales and the marker are understood: nothing unexpected
    assert load_(model, path) == torchsurgery.LoadResult([], [])
    same_state(model, reference)
    torch.testing.assert_close(outputs(model), outputs(reference), rtol=0, atol=0)
    assert [id(p) for p in model.parameters()] == ids
    torchsurgery.restore(model)
    same_state(model, before)


@pytest.mark.parametrize("how", ["skeleton", "skeleton-copy", "assign", "bf16"])
def test_new_tensors_get_the_dequantised_values(comfy: tuple[Path, dict[str, torch.Tensor]], how: str) -> None:
    path, state = comfy
    reference = dequantised(state)
    if how.startswith("skeleton"):
        with torchsurgery.skeleton():
            model = llama()
    else:
        model = llama()
    dtype = torch.bfloat16 if how == "bf16" else None
    load_(model, path, assign=how == "assign", copy=how == "skeleton-copy", dtype=dtype)
    # a scaled weight stands for its values in the model's dtype (or dtype=), never for its float8 bytes
    theirs = reference.to(dtype or torch.float32).state_dict()
    for key, value in model.state_dict().items():
        expected = theirs[key]
        if how == "assign" and f"{key.removesuffix('weight')}scale_weight" not in state:
            expected = expected.to(state[key].dtype)  # assign takes the checkpoint's tensors (bf16 biases)
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("per", ["tensor", "channel"])
def test_a_scaled_offload_takes_the_float8_values_and_the_scale_as_stored(
    comfy: tuple[Path, dict[str, torch.Tensor]], per: str
) -> None:
    path, state = comfy
    reference = dequantised(state)
    model = llama()
    twin = copy.deepcopy(model)
    offload(twin, storage_dtype=Scaled(torch.float8_e4m3fn, per=per)).remove()
    offload(model, storage_dtype=Scaled(torch.float8_e4m3fn, per=per))
    assert load_(model, path) == torchsurgery.LoadResult([], [])
    for name, layer in model.named_modules():
        if isinstance(layer, nn.Linear):
            weight = layer.weight
            # no round trip through a wide dtype: the file's bytes, the file's scale (broadcast per channel)
            assert torch.equal(weight.stored.view(torch.uint8), state[f"{name}.weight"].view(torch.uint8)), name
            assert torch.all(scale_of(weight) == state[f"{name}.scale_weight"]), name
            torch.testing.assert_close(weight, reference.get_submodule(name).weight, rtol=0, atol=0)
    # the scale multiplies the sums instead of the weight: the same values, rounded once differently
    torch.testing.assert_close(outputs(model), outputs(reference), rtol=1e-5, atol=1e-5)
    torchsurgery.restore(model)  # the load, then the offload: as if the file had never been loaded
    same_state(model, twin)


def test_another_float8_dtype_is_quantised_again_with_a_new_scale(tmp_path: Path) -> None:
    path = tmp_path / "e5m2.safetensors"
    reference = dequantised(write_comfy(llama(), path, torch.float8_e5m2))
    model = llama()
    offload(model, storage_dtype=Scaled(torch.float8_e4m3fn, per="tensor"))
    load_(model, path)
    for name, layer in model.named_modules():
        if isinstance(layer, nn.Linear):
            expected = reference.get_submodule(name).weight
            assert layer.weight.stored.dtype == torch.float8_e4m3fn
            # e4m3's grid with its own scale: within half a step of e4m3 (3 mantissa bits) of the largest value
            assert (layer.weight - expected).abs().max() <= expected.abs().max() / 16, name


@pytest.mark.parametrize("kind", ["plain", "scaled offload"])
def test_a_load_failing_half_way_leaves_every_weight_as_it_was(
    comfy: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    from torchsurgery.tensors import loading

    path, _ = comfy
    model = llama()
    if kind == "scaled offload":
        offload(model, storage_dtype=Scaled(torch.float8_e4m3fn))
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    before = [copy.deepcopy(w.__dict__.get("_torchsurgery_stored", w.detach())) for w in weights]
    scales = [scale_of(w).clone() for w in weights] if kind == "scaled offload" else []
    name = "load_scaled" if kind == "scaled offload" else "dequantize"
    real = getattr(loading, name)
    calls = 0

    def flaky(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:  # two weights written already
            raise OSError("disk went away")
        return real(*args)

    monkeypatch.setattr(loading, name, flaky)
    with pytest.raises(OSError, match="disk went away"):
        load_(model, path)
    for weight, old in zip(weights, before, strict=True):
        now = weight.__dict__.get("_torchsurgery_stored", weight.detach())
        assert torch.equal(now.view(torch.uint8), old.view(torch.uint8))
    for weight, old in zip(weights if scales else [], scales, strict=True):
        assert torch.equal(scale_of(weight), old)
    assert not torchsurgery.surgery_log(model) or all(e.kind != "load" for e in torchsurgery.surgery_log(model))


def _rewritten(path: Path, state: dict[str, torch.Tensor], **changes: torch.Tensor) -> Path:
    save_file({**state, **changes}, path.with_name("changed.safetensors"))
    return path.with_name("changed.safetensors")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model.layers.0.mlp.up_proj.scale_weight": torch.ones(2)}, r"up_proj.scale_weight' has shape \[2\].*one scale per weight"),
        ({"model.layers.0.mlp.up_proj.scale_weight": torch.ones(1, dtype=torch.int32)}, r"stored in torch.int32.*float32 number"),
        ({"model.norm.scale_weight": torch.ones(())}, r"scales 'model.norm.weight', which the checkpoint holds in torch.float32"),
    ],
    ids=["shape", "dtype", "not-fp8"],
)
def test_scales_that_cannot_be_read_are_refused_and_nothing_changes(
    comfy: tuple[Path, dict[str, torch.Tensor]], change: dict[str, torch.Tensor], message: str
) -> None:
    path, state = comfy
    bad = _rewritten(path, state, **change)
    model = llama()
    before = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match=message) as info:
        load_(model, bad)
    assert "save the values it stands for" in str(info.value)  # the fix
    same_state(model, before)
    assert torchsurgery.surgery_log(model) == []
    with torchsurgery.skeleton():
        skeleton = llama()
    with pytest.raises(ValueError, match=message):
        offload(skeleton, storage=bad)


def test_keys_stay_strict_around_the_scales(comfy: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = comfy
    # a scale whose weight the module lacks is as unexpected as its weight
    extra = {"extra.weight": torch.ones(2, 2, dtype=torch.float8_e4m3fn), "extra.scale_weight": torch.ones(())}
    with pytest.raises(RuntimeError, match=r"unexpected: 'extra.scale_weight'(.|\n)*unexpected: 'extra.weight'"):
        load_(llama(), _rewritten(path, state, **extra))
    assert load_(llama(), _rewritten(path, state, **extra), strict=False).unexpected_keys == ["extra.scale_weight", "extra.weight"]
    # a weight left out is missing, and its scale then unexpected
    fewer = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file(fewer, path.with_name("fewer.safetensors"))
    result = load_(llama(), path.with_name("fewer.safetensors"), strict=False)
    assert result == torchsurgery.LoadResult(["lm_head.weight"], ["lm_head.scale_weight"])


def test_a_float8_weight_without_a_scale_is_a_plain_float8_tensor(comfy: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = comfy
    unscaled = _rewritten(path, {k: v for k, v in state.items() if k != "lm_head.scale_weight"})
    model = llama()
    assert load_(model, unscaled) == torchsurgery.LoadResult([], [])
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"].float())  # scale 1, as ComfyUI reads it


# ---------------------------------------------------------------------- offload(storage=)


@pytest.mark.parametrize("how", ["streamed", "leaves", "part resident", "resident"])
def test_streaming_from_the_file_computes_with_the_dequantised_values(
    comfy: tuple[Path, dict[str, torch.Tensor]], how: str
) -> None:
    path, state = comfy
    reference = dequantised(state)
    expected = outputs(reference)
    with torchsurgery.skeleton():
        model = llama()
    total = sum(p.nbytes for p in reference.parameters())
    kwargs: dict[str, Any] = {
        "streamed": {}, "leaves": {"groups": "leaves"}, "part resident": {"budget": total * 7 // 8}, "resident": {"budget": 2 * total},
    }[how]
    handle = offload(model, storage=path, **kwargs)
    assert all(p.file_scale == f"{p.file_key.removesuffix('weight')}scale_weight" for p in handle.plan.params if p.file_scale)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(p.file_scale is not None for p in handle.plan.params) == linears  # every Linear weight: read narrow
    if how == "part resident":
        assert handle.stats().streamed_groups and handle.stats().resident_groups
    for _ in range(3):  # the first forward may make streamed groups resident, from the file's bytes
        torch.testing.assert_close(outputs(model), expected, rtol=0, atol=0)
    if how == "part resident":  # it did: measured after the first forward
        assert not handle.stats().streamed_groups
    handle.remove()
    assert all(p.is_meta for p in model.parameters())


def test_a_model_with_the_files_values_streams_from_it_and_gets_them_back(comfy: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = comfy
    reference = dequantised(state)
    model = llama()
    load_(model, path)
    handle = offload(model, storage=path)  # the file proven to hold the model's values: q * scale
    assert all(p.is_meta for p in model.model.layers.parameters())
    torch.testing.assert_close(outputs(model), outputs(reference), rtol=0, atol=0)
    handle.remove()
    same_state(model, reference)


@pytest.mark.accelerator
@pytest.mark.parametrize("how", ["load", "scaled offload", "streamed"])
def test_on_the_accelerator(accelerator: torch.device, comfy: tuple[Path, dict[str, torch.Tensor]], how: str) -> None:
    path, state = comfy
    reference = dequantised(state).to(accelerator)
    expected = outputs(reference, accelerator)
    if how == "streamed":
        with torchsurgery.skeleton():
            model = llama()
        with pytest.raises(torchsurgery.BudgetError) as least:  # the least budget: every group streams
            torchsurgery.plan_offload(model, accelerator, budget=1, groups="leaves", storage=path)
        handle = offload(model, accelerator, storage=path, budget=least.value.needed, groups="leaves")
    else:
        model = llama().to(accelerator)
        if how == "scaled offload":
            offload(model, accelerator, storage_dtype=Scaled(torch.float8_e4m3fn, per="channel"))
        load_(model, path)
    got = outputs(model, accelerator)
    if how == "scaled offload":
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        weight = model.lm_head.weight
        assert weight.device == accelerator and torch.equal(weight.stored.cpu().view(torch.uint8), state["lm_head.weight"].view(torch.uint8))
    else:
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    if how == "streamed":
        assert handle.stats().streamed_groups
        handle.remove()


# ---------------------------------------------------------------------- ComfyUI's comfy_quant layers


def test_comfy_quant_layers_load_into_a_plain_model_as_comfyui_dequantises_them(tmp_path: Path) -> None:
    # refused before: "unexpected key 'lm_head.comfy_quant'"
    path = tmp_path / "model_comfy_quant.safetensors"
    state = write_comfy(llama(), path, layout="comfy_quant")
    reference = dequantised(state)
    model = llama()
    result = load_(model, path)
    assert result == torchsurgery.LoadResult([], [])
    same_state(model, reference)
    torch.testing.assert_close(outputs(model), outputs(reference), rtol=0, atol=0)


@pytest.mark.parametrize("per", ["tensor", "channel"])
def test_comfy_quant_layers_give_a_scaled_offload_their_float8_values_and_scale(tmp_path: Path, per: str) -> None:
    path = tmp_path / "model_comfy_quant.safetensors"
    state = write_comfy(llama(), path, layout="comfy_quant")
    model = llama()
    handle = offload(model, storage_dtype=Scaled(torch.float8_e4m3fn, per=per), dtype=torch.float32)
    load_(model, path)
    for name, layer in ((n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)):
        assert torch.equal(layer.weight.stored.view(torch.uint8), state[f"{name}.weight"].view(torch.uint8)), name
        assert torch.all(scale_of(layer.weight) == state[f"{name}.weight_scale"]), name
    torch.testing.assert_close(outputs(model), outputs(dequantised(state)))
    handle.remove()


def test_a_model_streams_from_comfy_quant_layers(tmp_path: Path) -> None:
    path = tmp_path / "model_comfy_quant.safetensors"
    state = write_comfy(llama(), path, layout="comfy_quant")
    with torchsurgery.skeleton():
        model = llama()
    handle = offload(model, storage=path, dtype=torch.float32, groups="leaves")
    torch.testing.assert_close(outputs(model), outputs(dequantised(state)), rtol=1e-5, atol=1e-5)
    handle.remove()


def test_a_comfy_quant_format_not_read_is_refused_by_its_scale_and_nothing_changes(tmp_path: Path) -> None:
    # int8 per row (int8_tensorwise): an int8 weight with a scale per output, not float8 with one number
    model = llama()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    layer = "model.layers.0.mlp.up_proj"
    weight = state[f"{layer}.weight"]
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    state[f"{layer}.weight"] = (weight / scale).round().to(torch.int8)
    state[f"{layer}.weight_scale"] = scale.float()
    state[f"{layer}.comfy_quant"] = _comfy_quant_marker("int8_tensorwise")
    path = tmp_path / "int8.safetensors"
    save_file(state, path)
    target = llama()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(Exception, match=r"up_proj.weight_scale' scales .*torch.int8: a weight_scale belongs to a float8"):
        load_(target, path)
    same_state(target, _holding(before))


def _holding(values: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    model = llama()
    model.load_state_dict(values)
    return model
