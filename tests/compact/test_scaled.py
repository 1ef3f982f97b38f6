"""Tests of the scaled storage formats (``torchsurgery.compact.Scaled``) under ``offload``.

The reference throughout is the plain model whose weights hold the dequantised values
``(q.float() * scale).to(dtype)``: an offloaded scaled weight must compute, read, save and
come back as that plain weight does.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import torchsurgery
from _scaled_formats import FORMATS, IDS
from torchsurgery import OffloadedTensor, offload
from torchsurgery.compact import Scaled, own_scale
from torchsurgery.compact.scaled import dequantize, scaled_product


def mlp() -> nn.Sequential:
    """Linear layers at a typical weight scale (std 0.02, where unscaled fp8 is subnormal), a norm between."""
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16))
    with torch.no_grad():
        for layer in (model[0], model[3]):
            layer.weight.normal_(0, 0.02)
    return model


def dequantised(model: nn.Module, fmt: Scaled) -> nn.Module:
    """A plain copy of ``model`` whose Linear weights hold the values ``fmt`` keeps (biases, norms keep theirs)."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for layer in reference.modules():
            if isinstance(layer, nn.Linear):
                layer.weight.copy_(dequantize(*fmt.quantize(layer.weight), torch.float32))
    return reference


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("rows", [1, 5, 24])  # the native kernel's rows (fp8), and the widening path
def test_outputs_equal_the_plain_model_with_the_dequantised_weights(fmt: Scaled, rows: int) -> None:
    model = mlp()
    reference = dequantised(model, fmt)
    offload(model, storage_dtype=fmt, dtype=torch.float32)
    x = torch.randn(rows, 32)
    with torch.no_grad():
        got, expected = model(x), reference(x)
    # the scale multiplies the sums instead of the weight: the same values, rounded once differently
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert (got - expected).abs().max() < 1e-3 * expected.abs().max()


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_gradients_flow_as_for_the_plain_weight(fmt: Scaled) -> None:
    model = mlp()
    reference = dequantised(model, fmt)
    offload(model, storage_dtype=fmt, dtype=torch.float32)
    x = torch.randn(4, 32)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None
        assert mine.grad.dtype == torch.float32, name
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_it_reads_as_the_compute_dtype_and_its_state_dict_holds_the_dequantised_values(fmt: Scaled) -> None:
    model = mlp()
    reference = dequantised(model, fmt)
    offload(model, storage_dtype=fmt, dtype=torch.float32)
    weight = model[0].weight
    assert isinstance(weight, OffloadedTensor) and isinstance(weight, nn.Parameter)
    assert weight.dtype == torch.float32 and weight.stored.dtype == fmt.dtype
    assert type(model[0].bias) is nn.Parameter and model[2].weight.dtype == torch.float32  # bias, norm kept
    torch.testing.assert_close(weight * 1, reference[0].weight, rtol=0, atol=0)
    torch.testing.assert_close(weight.t(), reference[0].weight.t(), rtol=0, atol=0)  # views read scaled too
    torch.testing.assert_close(weight[5:9], reference[0].weight[5:9], rtol=0, atol=0)
    state = model.state_dict()
    for name, value in reference.state_dict().items():
        assert state[name].dtype == value.dtype and type(state[name]) is torch.Tensor, name
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    q, scale = weight.stored.clone(), weight.__dict__["_torchsurgery_scale"].clone()
    model.load_state_dict(state)  # its own values back: the same q and scale
    assert torch.equal(weight.stored.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(weight.__dict__["_torchsurgery_scale"], scale)
    plain = mlp()
    plain.load_state_dict(state)  # and a plain model takes them as they are
    torch.testing.assert_close(plain[0].weight, reference[0].weight, rtol=0, atol=0)


@pytest.mark.parametrize("undo", ["remove", "restore"])
@pytest.mark.parametrize("fmt", FORMATS[::3], ids=IDS[::3])
def test_undo_gives_back_the_same_parameters_with_the_dequantised_values(fmt: Scaled, undo: str) -> None:
    model = mlp()
    reference = dequantised(model, fmt)
    ids = [id(p) for p in model.parameters()]
    handle = offload(model, storage_dtype=fmt, dtype=torch.float32)
    if undo == "remove":
        handle.remove()
    else:
        torchsurgery.restore(model)
    assert [id(p) for p in model.parameters()] == ids
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert type(mine) is nn.Parameter and mine.dtype == torch.float32, name
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)


def test_writes_are_rounded_to_the_weights_grid() -> None:
    fmt = Scaled(torch.int8)
    model = mlp()
    offload(model, storage_dtype=fmt, dtype=torch.float32)
    weight = model[0].weight
    before = weight * 1
    with torch.no_grad():
        weight[3] = 0  # through a view: lands in q, the scale kept
        weight.mul_(0.5)  # in place: rounded to the grid of the same scale
    expected = before.clone()
    expected[3] = 0
    scale = weight.__dict__["_torchsurgery_scale"]
    grid = dequantize(torch.round(expected * 0.5 / scale).to(torch.int8), scale, torch.float32)
    torch.testing.assert_close(weight * 1, grid, rtol=0, atol=0)
    assert weight.stored.dtype == torch.int8


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_what_the_offload_holds_and_reads_counts_the_scales(fmt: Scaled) -> None:
    model = mlp()
    handle = offload(model, storage_dtype=fmt, dtype=torch.float32, budget=1 << 20)  # kept whole
    weights = [model[0].weight, model[3].weight]
    scales = [own_scale(w) for w in weights]
    assert all(s is not None and s.dtype == torch.float32 for s in scales)
    kept = sum(w.stored.nbytes for w in weights) + sum(s.nbytes for s in scales if s is not None)
    others = sum(p.nbytes for p in model.parameters() if not isinstance(p, OffloadedTensor))
    assert handle.stats().resident_bytes == kept + others  # the groups as held
    with torch.no_grad():
        model(torch.randn(2, 32))
    assert handle.stats().bytes_moved == kept  # each product reads its weight's q and scale


def test_a_deep_copy_keeps_the_scale() -> None:
    model = mlp()
    offload(model, storage_dtype=Scaled(torch.float8_e4m3fn), dtype=torch.float32)
    copied = copy.deepcopy(model[0].weight)
    torch.testing.assert_close(copied * 1, model[0].weight * 1, rtol=0, atol=0)


def test_the_scale_is_applied_to_the_sums_of_the_narrow_values() -> None:
    fmt = Scaled(torch.float8_e4m3fn)
    w = torch.randn(6, 8) * 0.02
    q, scale = fmt.quantize(w)
    seen: list[torch.dtype] = []

    def product(x: torch.Tensor, weight: torch.Tensor, s: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        seen.append(weight.dtype)
        out = x @ weight.to(x.dtype).T
        out = out if s is None else out * s
        return out if b is None else out + b

    x, bias = torch.randn(3, 8), torch.randn(6)
    out = scaled_product(x, q, scale.expand(q.shape), bias, product)
    assert seen == [torch.float8_e4m3fn]  # the product read q itself, not a dequantised weight
    torch.testing.assert_close(out, x @ dequantize(q, scale, torch.float32).T + bias, rtol=1e-5, atol=1e-7)
    # a view whose scale runs along the sums (the transpose of a per-channel weight) is dequantised first
    square_q, square_scale = fmt.quantize(torch.randn(8, 8))
    out = scaled_product(x, square_q.t(), square_scale.expand(8, 8).t(), None, product)
    assert seen[-1] == torch.float32
    torch.testing.assert_close(out, x @ dequantize(square_q, square_scale, torch.float32), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"dtype": torch.bfloat16}, ["torchsurgery.compact.Scaled", "torch.bfloat16", "storage_dtype itself"]),
        ({"dtype": torch.float8_e4m3fn, "per": "row"}, ["torchsurgery.compact.Scaled", "'row'", "per='channel'"]),
        ({"dtype": torch.int8, "per": "tensor"}, ["torchsurgery.compact.Scaled", "tensor", "Scaled(torch.int8, per='channel')"]),
    ],
)
def test_bad_formats_are_refused_naming_the_value_and_the_fix(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        Scaled(**kwargs)
    for word in words:
        assert word in str(caught.value)


class _Tagged(nn.Parameter):
    """A parameter subclass of the model's own: converted at each run, never packed or wrapped."""


def _tagged_conv() -> nn.Module:
    model = nn.Sequential(nn.Conv2d(3, 4, 3))
    model[0].weight = _Tagged(model[0].weight.detach())
    return model


@pytest.mark.parametrize(
    ("make", "options", "words"),
    [
        # a CPU streams the weights no matmul layer reads narrow; a tensor subclass is converted at each run
        (_tagged_conv, {}, ["torchsurgery.offload", "'0.weight' is a _Tagged", "skip=", "torch.bfloat16"]),
        (mlp, {"master_dtype": torch.float32}, ["torchsurgery.offload", "master_dtype", "scale again", "leave out master_dtype"]),
    ],
)
def test_what_is_not_built_yet_is_refused_changing_nothing(make: Any, options: dict[str, Any], words: list[str]) -> None:
    model = make()
    before = {name: (id(p), type(p), p.detach().clone()) for name, p in model.named_parameters()}
    with pytest.raises(ValueError) as caught:
        offload(model, "cpu", storage_dtype=Scaled(torch.int8), dtype=torch.float32, groups="leaves", **options)
    for word in words:
        assert word in str(caught.value)
    for name, p in model.named_parameters():
        assert (id(p), type(p)) == before[name][:2] and torch.equal(p, before[name][2])
    assert not torchsurgery.surgery_log(model)


@pytest.mark.accelerator
@pytest.mark.parametrize("fmt", FORMATS[::3], ids=IDS[::3])
def test_on_the_accelerator_outputs_equal_the_dequantised_model(
    fmt: Scaled, accelerator: torch.device, exact_on_tardy: dict[str, float]
) -> None:
    model = mlp()
    reference = dequantised(model, fmt).to(accelerator)
    offload(model, accelerator, storage_dtype=fmt, dtype=torch.float32)  # kept whole on the device
    assert model[0].weight.stored.device == accelerator and model[0].weight.stored.dtype == fmt.dtype
    x = torch.randn(3, 32, device=accelerator)
    with torch.no_grad():  # dequantised for each product, as a streamed weight is into its ring slot
        torch.testing.assert_close(model(x), reference(x), **exact_on_tardy)


def _every_pattern(fmt: Scaled, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Every value ``fmt``'s dtype holds (NaN and the infinities included) in each of 8 rows, and
    a scale whose mantissa no compute dtype narrower than fp32 holds (per row, or one)."""
    q = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(fmt.dtype).repeat(8, 1)
    torch.manual_seed(31)
    scale = torch.rand(8, 1) * 3 + 1e-3 if fmt.per == "channel" else torch.tensor(0.0123457)
    return q.to(device), scale.to(device)


def _bits_equal(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """The same dtype, the same NaNs, and every other value the same bits."""
    nan = expected.isnan()
    return got.dtype == expected.dtype and torch.equal(got.isnan(), nan) and torch.equal(got[~nan], expected[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_dequantize_is_the_formula_bit_for_bit_for_every_pattern(fmt: Scaled, dtype: torch.dtype) -> None:
    # bf16 and fp16 are widened into the result and scaled there: the product must still be
    # computed in fp32 and rounded once, as (q.float() * scale).to(dtype) is, a 0-d scale too
    q, scale = _every_pattern(fmt)
    assert _bits_equal(dequantize(q, scale, dtype), (q.float() * scale).to(dtype))


@pytest.mark.accelerator
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_dequantize_on_the_accelerator_is_the_formula_on_the_host_bit_for_bit(
    fmt: Scaled, accelerator: torch.device
) -> None:
    # as a streamed weight is widened into its ring slot, in the compute dtypes of the GPU
    q, scale = _every_pattern(fmt)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = dequantize(q.to(accelerator), scale.to(accelerator), dtype)
        assert got.device == accelerator and _bits_equal(got.cpu(), (q.float() * scale).to(dtype))


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_narrow_compute_dtype_sums_scaled_values_as_the_plain_layer_does(fmt: Scaled, compiled: bool) -> None:
    # fp16 compute: summing the unscaled values (e4m3's reach 448, int8's 127) in fp16 overflowed
    # rows of 1024 (e4m3), 64 (e5m2) or 4096 (int8) positive products to inf, where the plain
    # fp16 layer holding the dequantised values gives about 5, 0.3 and 22
    torch._dynamo.reset()
    for width in (64, 1024, 4096):
        layer = nn.Linear(width, 3, bias=False)
        with torch.no_grad():
            layer.weight.uniform_(0.001, 0.01)
        handle = offload(layer, storage_dtype=fmt, dtype=torch.float16, groups=[""])
        plain = nn.Linear(width, 3, bias=False).half()
        with torch.no_grad():
            plain.weight.copy_(layer.weight)  # the values the weight reads as, in fp16
            x = torch.rand(2, width, dtype=torch.float16)
            run = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
            got, want = run(x), plain(x)
        assert bool(want.isfinite().all()) and bool(got.isfinite().all()), (width, got)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-3)
        handle.remove()
    torch._dynamo.reset()


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_a_weight_with_an_inf_or_nan_is_refused_by_name_and_the_model_is_left_as_it_was(fmt: Scaled, bad: float) -> None:
    # its channel's scale (per tensor: the weight's) would be inf or NaN, and every value it
    # scales NaN, with remove() giving the NaNs back: refused before anything changes
    model = mlp()
    with torch.no_grad():
        model[3].weight[2, 5] = bad
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = [id(p) for p in model.parameters()]
    with pytest.raises(ValueError, match=r"'3\.weight': 1 of its values are inf or NaN") as refused:
        offload(model, storage_dtype=fmt, dtype=torch.float32)
    assert torchsurgery.surgery_log(model) == [] and [id(p) for p in model.parameters()] == ids
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, equal_nan=True)
    assert "(skip=lambda module, name: name == '3')" in str(refused.value)  # the way out it names, taken:
    handle = offload(model, storage_dtype=fmt, dtype=torch.float32, skip=lambda module, name: name == "3")
    assert not isinstance(model[3].weight, OffloadedTensor) and isinstance(model[0].weight, OffloadedTensor)
    handle.remove()


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("file_dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32-file", "fp8-file-without-scale"])
def test_load_of_plain_values_chooses_a_scale_from_them(fmt: Scaled, file_dtype: torch.dtype, tmp_path: Any) -> None:
    # values 100x those offloaded: a load that kept the old scale saturated them (read back at
    # about 1%); the weight must hold what the format keeps of the file's values, as the plain
    # model loaded from the same file and quantised by the same format holds them
    from safetensors.torch import save_file

    model = mlp()
    new = {k: (v * 100).to(file_dtype if v.dim() == 2 else v.dtype) for k, v in mlp().state_dict().items()}
    save_file(new, tmp_path / "new.safetensors")
    plain = mlp()
    plain.load_state_dict({k: v.float() for k, v in new.items()})
    reference = dequantised(plain, fmt)
    handle = offload(model, storage_dtype=fmt, dtype=torch.float32)
    torchsurgery.load_(model, tmp_path / "new.safetensors")
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    x = torch.randn(3, 32)
    with torch.no_grad():  # the sums of q, scaled, against the plain matmul: fp32 apart (outputs near 100)
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-3)
    handle.remove()


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_an_all_zero_channel_reads_as_zeros(fmt: Scaled) -> None:
    # a pruned output channel: its largest magnitude is 0, and a scale of 0 would make it 0 / 0
    layer = nn.Linear(16, 4)
    with torch.no_grad():
        layer.weight[2] = 0.0
    plain = dequantised(layer, fmt)
    handle = offload(layer, storage_dtype=fmt, dtype=torch.float32, groups=[""])
    assert torch.equal(layer.weight[2], torch.zeros(16)) and not bool(layer.weight.isnan().any())
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), plain(x))
        assert torch.equal(layer(x)[:, 2], layer.bias[2].expand(3))  # the channel adds its bias alone
    handle.remove()
    assert torch.equal(layer.weight[2], torch.zeros(16))


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_a_write_past_a_rows_range_saturates_and_never_wraps_around(fmt: Scaled) -> None:
    # the scale stays (docs/offload.md): a value past the row's largest is stored as the largest,
    # with its sign; int8 values converted without a clamp wrap around (300 -> 44, -300 -> -44)
    layer = nn.Linear(8, 3, bias=False)
    handle = offload(layer, storage_dtype=fmt, dtype=torch.float32, groups=[""])
    largest = layer.weight.detach().abs().amax(dim=1, keepdim=fmt.per == "channel")
    if fmt.per == "tensor":
        largest = layer.weight.detach().abs().amax().expand(3, 1)
    with torch.no_grad():
        layer.weight[:, 0] = 1000.0 * largest[:, 0]
        layer.weight[:, 1] = -1000.0 * largest[:, 0]
    read = layer.weight.detach()
    torch.testing.assert_close(read[:, 0], largest[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(read[:, 1], -largest[:, 0], rtol=0, atol=0)
    handle.remove()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_a_conversion_out_of_a_scaled_format_says_so_once_and_computes_as_the_plain_module(dtype: torch.dtype) -> None:
    # .to(dtype) of a scaled model keeps its weights whole from then on (2 to 8 times the memory):
    # it was silent, where plain fp8 storage keeps its format; the values are the plain module's
    fmt = Scaled(torch.float8_e4m3fn)
    model = mlp()
    reference = dequantised(model, fmt).to(dtype)
    handle = offload(model, storage_dtype=fmt, dtype=torch.float32)
    with pytest.warns(UserWarning, match=r"takes 2 weight\(s\) out of the scaled format .*offload it again") as told:
        model.to(dtype)
    assert len(told) == 1
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.detach().clone(), want.detach(), rtol=0, atol=0)
    plain_fp8 = mlp()
    kept = offload(plain_fp8, storage_dtype=torch.float8_e4m3fn, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain_fp8.to(dtype)  # a plain narrow dtype is kept: nothing to say
    assert plain_fp8[0].weight.stored.dtype == torch.float8_e4m3fn
    kept.remove()
    handle.remove()


_VIEWS = {
    "view(-1)": lambda t: t.view(-1),
    "flatten": lambda t: t.flatten(),
    "reshape": lambda t: t.reshape(6, 16),
    "view(6, 16)": lambda t: t.view(6, 16),
    "parameters_to_vector": lambda t: nn.utils.parameters_to_vector([t]),
    "item": lambda t: torch.tensor(t[0, 0].item()),
    "float": lambda t: torch.tensor(float(t[1][2])),
    "scalar * 2": lambda t: t[2, 5] * 2,
    "t().reshape(-1)": lambda t: t.t().reshape(-1),
}


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("view", list(_VIEWS))
def test_views_and_elements_of_a_scaled_weight_read_as_the_plain_weights(fmt: Scaled, view: str) -> None:
    # per channel the scale is broadcast along each row: views that merge rows (view(-1),
    # flatten, parameters_to_vector) raised, and so did every single element (w[0, 0].item())
    layer = nn.Linear(16, 6)
    plain = dequantised(layer, fmt)
    handle = offload(layer, storage_dtype=fmt, dtype=torch.float32, groups=[""])
    with torch.no_grad():
        got, want = _VIEWS[view](layer.weight), _VIEWS[view](plain.weight)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    handle.remove()


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_a_zero_size_weight_is_kept_scaled_as_the_plain_one(fmt: Scaled) -> None:
    # a layer of no inputs: its largest magnitude is that of nothing (an IndexError from amax)
    model = nn.Sequential(nn.Linear(0, 3), nn.Linear(3, 4))
    plain = copy.deepcopy(model)
    handle = offload(model, storage_dtype=fmt, dtype=torch.float32)
    assert model[0].weight.shape == (3, 0) and own_scale(model[0].weight) is not None
    with torch.no_grad():
        torch.testing.assert_close(model[0](torch.randn(2, 0)), plain[0](torch.randn(2, 0)))
    handle.remove()
    assert model[0].weight.shape == (3, 0)
