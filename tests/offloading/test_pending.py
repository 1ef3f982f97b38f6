"""A graph recorded while a model was offloaded outlives the offload: ``with offload(model): y = model(x)``
in grad mode exits, gives every weight back, and ``y``'s backward gives the restored parameters the
gradients the plain model with the same weights gives its own (torchsurgery/offloading/pending.py)."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
from _offload_models import mlp, rounded_reference
from torch import nn

import torchsurgery
from torchsurgery import offload
from torchsurgery.compact import Scaled
from torchsurgery.offloading import stored_values

X = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))

STORAGES: dict[str, dict[str, Any]] = {
    # (on a CPU a weight stored in the dtype it computes in stays as it is: nothing to give back)
    "fp64": {"storage_dtype": torch.float64, "dtype": torch.float32},
    "bf16": {"storage_dtype": torch.bfloat16, "dtype": torch.float32},
    "scaled": {"storage_dtype": Scaled(torch.float8_e4m3fn), "dtype": torch.float32},
    "master": {"storage_dtype": torch.bfloat16, "dtype": torch.float32, "master_dtype": torch.float32},
}
EXACT = ("fp64", "master")  # the weights given back hold the original values


def _plain(model: nn.Module) -> nn.Module:
    """A plain copy of ``model`` (once given back: plain parameters with the values it computed with)."""
    reference = copy.deepcopy(model)
    for p in reference.parameters():
        p.grad = None
    return reference


def _identity(model: nn.Module) -> list[tuple[str, int, type, torch.device, torch.dtype]]:
    return [(n, id(p), type(p), p.device, p.dtype) for n, p in model.named_parameters()]


def _grads_equal(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert p.grad.device == p.device and p.grad.dtype == p.dtype, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("storage", list(STORAGES))
def test_a_with_block_in_grad_mode_exits_and_the_backward_after_it_reaches_the_restored_weights(storage: str) -> None:
    model = mlp(blocks=2, d=16).eval()
    original, before = _plain(model), _identity(model)
    with offload(model, **STORAGES[storage]) as handle:
        y = model(X)  # grad mode: its graph holds the offloaded weights past the block
    assert not handle.active and torchsurgery.surgery_log(model) == []
    assert _identity(model) == before  # the same objects, plain, on their device in their dtype
    if storage in EXACT:
        for (name, p), q in zip(model.named_parameters(), original.parameters(), strict=True):
            assert torch.equal(p, q), name
    reference = _plain(model)  # the plain model with the weights the offloaded one computed with
    expected = reference(X)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
    y.square().sum().backward()
    expected.square().sum().backward()
    _grads_equal(model, reference)


def test_a_graph_kept_past_the_block_backwards_again_and_differentiates_its_input() -> None:
    model = mlp(blocks=2, d=16).eval()
    reference = copy.deepcopy(model)
    x, x_plain = X.clone().requires_grad_(), X.clone().requires_grad_()
    with offload(model, storage_dtype=torch.float64, dtype=torch.float32, groups="leaves"):
        y = model(x)
        y.sum().backward(retain_graph=True)  # into the offloaded weights: their gradients go back with them
    expected = reference(x_plain)
    expected.sum().backward(retain_graph=True)
    _grads_equal(model, reference)
    y.sum().backward(retain_graph=True)  # after the block: added to what the first one gave
    expected.sum().backward(retain_graph=True)
    _grads_equal(model, reference)
    (got,) = torch.autograd.grad(y.square().sum(), x)
    (want,) = torch.autograd.grad(expected.square().sum(), x_plain)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    _grads_equal(model, reference)  # torch.autograd.grad accumulates nothing


def test_a_graph_dropped_without_its_backward_frees_what_it_held() -> None:
    model = mlp(blocks=2, d=16).eval()
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
    kept = weakref.ref(stored_values(model[2].weight))  # what the weight is stored as while offloaded
    offloaded = weakref.ref(handle)
    y = model(X)
    handle.remove()
    del handle
    assert kept() is not None  # the graph still computes with it
    del y
    assert kept() is None  # at once, with the graph
    gc.collect()  # (the handle's own references go round)
    assert offloaded() is None
    assert all(p.grad is None for p in model.parameters())
    reference = _plain(model)  # the model goes on training as the plain one
    model(X).sum().backward()
    reference(X).sum().backward()
    _grads_equal(model, reference)


def test_a_training_step_whose_loss_outlives_the_offload_trains_as_the_plain_model() -> None:
    model = mlp(blocks=2, d=16)
    reference = copy.deepcopy(model)
    steps = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    with offload(model, storage_dtype=torch.float64, dtype=torch.float32, groups="leaves"):
        loss = model(X).square().mean()
        loss.backward()
        steps[0].step()
        steps[0].zero_grad()
        loss = model(X).square().mean()  # step 2, the last step's loss alive during its forward
    loss.backward()  # after the block: step 2's gradients reach the restored parameters
    steps[0].step()
    for _ in range(2):
        loss = reference(X).square().mean()
        loss.backward()
        steps[1].step()
        steps[1].zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")  # the plain model's too
def test_a_gradient_penalty_after_the_block_differentiates_the_gradients_as_the_plain_model() -> None:
    # backward(create_graph=True) twice, the first one's gradients saved by a penalty in between:
    # the second adds to them out of place, as autograd adds to a leaf's gradient in grad mode
    model = mlp(blocks=1, d=16).eval()
    reference = copy.deepcopy(model)
    with offload(model, storage_dtype=torch.float64, dtype=torch.float32, groups="leaves"):
        y = model(X)
    expected = reference(X)
    for m, out in ((model, y), (reference, expected)):
        out.square().sum().backward(create_graph=True, retain_graph=True)
        penalty = sum(p.grad.square().sum() for p in m.parameters())
        out.square().sum().backward(create_graph=True)
        penalty.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_conversion_while_a_backward_is_pending_hands_its_gradients_on_to_the_converted_weights() -> None:
    # .to(dtype) removes the offload and installs it again: the weights it offloads and those it
    # keeps (the norm) alike get the gradients of the graph recorded before, in their new dtype
    model = mlp(blocks=2, d=16).eval()
    reference = rounded_reference(model, torch.bfloat16)
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, groups="leaves")
    loss = model(X).square().sum()
    model.to(torch.float64)
    assert handle.active and all(p.dtype == torch.float64 for p in model.parameters())
    loss.backward()
    reference(X).square().sum().backward()
    handle.remove()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert p.grad.dtype == torch.float64, name
        torch.testing.assert_close(p.grad, q.grad.double(), rtol=1e-5, atol=1e-6, msg=name)
