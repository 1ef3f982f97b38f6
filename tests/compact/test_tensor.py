"""Tests of OffloadedTensor: a weight that reads as its compute dtype, its values kept narrower.

The reference throughout is the plain fp32 weight holding the same (storage-rounded) values:
whatever a program does with the offloaded weight, it must see what it would see with that.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchsurgery
from torchsurgery import OffloadedTensor, offload
from torchsurgery.offloading import stored_values


def layer_pair(storage: torch.dtype = torch.bfloat16, **kwargs: Any) -> tuple[nn.Linear, nn.Linear, Any]:
    """An offloaded Linear and a plain fp32 one with the same storage-rounded values."""
    layer = nn.Linear(16, 8)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(p.to(storage).float())
    plain = copy.deepcopy(layer)
    handle = offload(layer, storage_dtype=storage, dtype=torch.float32, groups=[""], **kwargs)
    return layer, plain, handle


def test_it_reads_as_the_compute_dtype_and_keeps_the_narrow_values() -> None:
    layer, plain, handle = layer_pair()
    w = layer.weight
    assert isinstance(w, OffloadedTensor) and isinstance(w, nn.Parameter) and w.requires_grad
    assert (w.dtype, w.device, w.shape, w.stride()) == (torch.float32, plain.weight.device, plain.weight.shape, plain.weight.stride())
    assert w.element_size() == 4 and w.stored.dtype == torch.bfloat16 and stored_values(w).nbytes == w.numel() * 2
    # any operation sees the fp32 values, and gives plain tensors (or itself, where the plain one does)
    for op in (lambda t: t * 2, lambda t: t.sum(0), lambda t: t.float(), lambda t: t.clone(), lambda t: t.cpu(),
               lambda t: t.to(torch.float64), lambda t: torch.tanh(t), lambda t: t[2:5].T.contiguous()):
        ours, theirs = w.detach(), plain.weight.detach()
        got, expected = op(ours), op(theirs)
        assert got is ours if expected is theirs else type(got) is torch.Tensor
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.equal(torch.empty_like(w).new_zeros(3), torch.zeros(3)) and torch.zeros_like(w).dtype == torch.float32
    assert "stored as torch.bfloat16" in repr(w)
    handle.remove()


@pytest.mark.parametrize("rows", [1, 3, 9, 40])
def test_products_equal_the_plain_layer_with_and_without_gradients(rows: int) -> None:
    layer, plain, handle = layer_pair()
    x = torch.randn(2, rows, 16)
    with torch.no_grad():  # the narrow kernel (few rows) or the widening buffer
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-6)
    y = torch.randn(2, rows, 8)
    F.mse_loss(layer(x), y).backward()
    F.mse_loss(plain(x), y).backward()
    for got, expected in ((layer.weight.grad, plain.weight.grad), (layer.bias.grad, plain.bias.grad)):
        assert type(got) is torch.Tensor and got.dtype == torch.float32  # as for an fp32 weight
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    handle.remove()


def test_a_dtype_the_plain_layer_refuses_is_refused_the_same_way() -> None:
    layer, plain, handle = layer_pair()
    for x in (torch.randn(2, 16, dtype=torch.bfloat16), torch.ones(2, 16, dtype=torch.int64)):
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                with pytest.raises(RuntimeError) as plain_error:
                    plain(x)
                with pytest.raises(RuntimeError) as ours:
                    layer(x)
            assert str(ours.value) == str(plain_error.value)
    handle.remove()  # the failed forwards kept no view of the weights alive


def test_writes_land_in_the_stored_values_through_views_data_and_optimizers() -> None:
    layer, plain, handle = layer_pair()
    with torch.no_grad():
        for w in (layer.weight, plain.weight):
            w[3] = 0.5  # through a view
            w.data[:, 0].mul_(2)  # through .data
            w.add_(torch.ones_like(w) / 4)  # in place
    torch.testing.assert_close(layer.weight.stored.float(), plain.weight.detach().bfloat16().float(), rtol=0, atol=0)
    assert layer.weight.stored[3, 1].item() == 0.75
    assert layer.weight.stored._version >= 3  # each write counted: what refreshes copies kept by version
    with torch.no_grad():
        plain.weight.copy_(layer.weight.stored)  # the plain reference holds the rounded values too
    before = layer.weight.stored._version
    for model in (layer, plain):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model(torch.ones(1, 16)).sum().backward()
        optimizer.step()
    assert layer.weight.stored._version > before  # what refreshes copies kept by version
    torch.testing.assert_close(layer.weight.stored, plain.weight.detach().bfloat16(), rtol=0, atol=0)
    handle.remove()


def test_state_dict_holds_the_stored_values_and_loads_back_exactly() -> None:
    layer, plain, handle = layer_pair()
    state = layer.state_dict()
    assert all(type(v) is torch.Tensor and v.dtype == torch.bfloat16 for v in state.values())
    assert state["weight"].data_ptr() == layer.weight.stored.data_ptr()  # no copy, as for a plain model
    assert layer.state_dict(keep_vars=True)["weight"] is layer.weight
    buffer = io.BytesIO()
    torch.save(state, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()))  # plain tensors: weights_only loading takes them
    fresh = nn.Linear(16, 8)
    fresh.load_state_dict(loaded)
    torch.testing.assert_close(fresh.weight, plain.weight, rtol=0, atol=0)
    with torch.no_grad():
        layer.weight.zero_()
    layer.load_state_dict(loaded)
    torch.testing.assert_close(layer.weight.stored, loaded["weight"], rtol=0, atol=0)
    handle.remove()


def test_copies_keep_the_values_exactly_and_share_nothing() -> None:
    layer, _, handle = layer_pair(storage=torch.float64)  # wider storage: a widened copy would round
    with torch.no_grad():
        layer.weight.stored.add_(1e-12)
    x = torch.randn(2, 16)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        w = clone.weight
        assert isinstance(w, OffloadedTensor) and w.dtype == torch.float32
        assert torch.equal(w.stored, layer.weight.stored) and w.stored.data_ptr() != layer.weight.stored.data_ptr()
        with torch.no_grad():
            torch.testing.assert_close(clone(x), layer(x), rtol=0, atol=0)
    handle.remove()


def test_user_attributes_on_a_weight_survive_the_offload_and_its_removal() -> None:
    layer = nn.Linear(4, 4)
    layer.weight.tag = "tied-to-something"
    handle = offload(layer, storage_dtype=torch.bfloat16, dtype=torch.float32, groups=[""])
    assert layer.weight.tag == "tied-to-something"
    handle.remove()
    assert type(layer.weight) is nn.Parameter and layer.weight.tag == "tied-to-something"


def test_a_master_copy_serves_gradients_and_a_refreshed_shadow_serves_inference() -> None:
    layer, plain, handle = layer_pair(master_dtype=torch.float32)
    layer.requires_grad_(False)  # a frozen base layer: its input needs no gradient either
    plain.requires_grad_(False)
    with torch.no_grad():
        layer.weight.add_(1e-3)  # master values between bf16 steps
        plain.weight.add_(1e-3)
    x = torch.randn(3, 16)
    assert layer.weight.stored.dtype == torch.float32
    torch.testing.assert_close(layer(x), plain(x), rtol=0, atol=0)  # records gradients: the fp32 master
    with torch.no_grad():  # no gradients: the bf16 shadow, refreshed after the write
        shadowed = F.linear(x, plain.weight.bfloat16().float(), plain.bias.bfloat16().float())
        torch.testing.assert_close(layer(x), shadowed, rtol=1e-5, atol=1e-6)
    handle.remove()


class _Tagged(nn.Parameter):  # a parameter subclass of the same dtype and device: not a wrapper
    pass


@pytest.mark.parametrize("into", ["narrow wrapper", "parameter subclass"])
def test_the_undo_log_swaps_a_patchs_converted_weights_back(into: str) -> None:
    # a patch may convert its module's weights with swap_tensors: unpatch swaps them back, into
    # their own class (``.data =`` would give back the values and keep the patch's class)
    class Narrowed(torchsurgery.Patch, nn.Linear):
        def __patch_init__(self) -> None:
            w = self.weight
            if into == "narrow wrapper":
                new = nn.Parameter(OffloadedTensor(w.detach().bfloat16(), torch.float32))
            else:
                new = _Tagged(w.detach().clone())
            torch.utils.swap_tensors(w, new)

    layer = nn.Linear(4, 4)
    weight, values = layer.weight, layer.weight.detach().clone()
    torchsurgery.patch(layer, Narrowed)
    assert layer.weight is weight and type(weight) is not nn.Parameter
    torchsurgery.unpatch(layer)
    assert layer.weight is weight and type(weight) is nn.Parameter and torch.equal(weight, values)


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("inp", "out", "rows"), [(0, 8, 2), (8, 0, 2), (8, 8, 0), (0, 0, 3)])
def test_empty_products_are_those_of_the_plain_layer(storage: torch.dtype, inp: int, out: int, rows: int) -> None:
    layer = nn.Linear(inp, out)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(p.to(storage).float())
    plain = copy.deepcopy(layer)
    handle = offload(layer, storage_dtype=storage, dtype=torch.float32, groups=[""])
    x = torch.randn(rows, inp)
    with torch.no_grad():
        got = layer(x)
    assert got.shape == (rows, out)
    torch.testing.assert_close(got, plain(x).detach(), rtol=0, atol=0)
    handle.remove()


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("inside", [True, False], ids=["in-its-mode", "outside-its-mode"])
def test_under_fake_tensor_mode_an_offloaded_model_computes_what_the_plain_model_does(
    storage: torch.dtype, grad: bool, inside: bool
) -> None:
    # the compiler's and export's tracers run a model on fake inputs (no memory behind them), also
    # with their mode no longer on the stack: a product by a narrow weight must leave them to the
    # tracer, never hand them to the kernel
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    plain = copy.deepcopy(model)
    handle = offload(model, storage_dtype=storage, dtype=torch.float32)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = mode.from_tensor(torch.randn(2, 64))
    with torch.set_grad_enabled(grad), mode if inside else contextlib.nullcontext():
        got, expected = model(fake), plain(fake)
    assert isinstance(got, FakeTensor)
    assert (got.shape, got.dtype, got.requires_grad) == (expected.shape, expected.dtype, expected.requires_grad)
    del got, expected, fake  # their graphs hold the weights
    handle.remove()


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float8_e4m3fn])
def test_dispatch_modes_see_the_products_of_an_offloaded_model(storage: torch.dtype) -> None:
    # make_fx records each product (as the narrow product operator) and FlopCounterMode counts it,
    # also without gradients, where the product is otherwise taken before dispatch
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.flop_counter import FlopCounterMode

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    plain = copy.deepcopy(model)
    handle = offload(model, storage_dtype=storage, dtype=torch.float32)
    x = torch.randn(2, 64)
    with torch.no_grad():
        traced = make_fx(model)(x)
        torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)
        counted = []
        for m in (plain, model):
            with FlopCounterMode(display=False) as flops:
                m(x)
            counted.append(flops.get_total_flops())
    assert counted[0] > 0 and counted[1] == counted[0]
    handle.remove()
