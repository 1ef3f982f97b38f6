"""An offloaded weight against a plain ``nn.Parameter`` holding the same rounded values: the tensor API.

Memory (``data_ptr``, storage, sharing), values read out (numpy, ``tolist``), ``.data``
assignment, views' storage offsets, in-place ops that change a shape, autocast, ``vmap``
and compiled forwards of master weights. The oracle is always the plain layer whose
weights are the offloaded layer's stored values widened.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import torchsurgery
from torchsurgery.compact import OffloadedTensor


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _pair(master: bool = False) -> tuple[nn.Sequential, nn.Sequential, torchsurgery.OffloadHandle]:
    """(offloaded model with bf16 storage, the plain model with its rounded weights, the handle)."""
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    plain = copy.deepcopy(model)
    handle = torchsurgery.offload(
        model, storage_dtype=torch.bfloat16, dtype=torch.float32, groups=[""],
        master_dtype=torch.float32 if master else None,
    )
    with torch.no_grad():
        for p in plain.parameters():
            if not master:
                p.copy_(p.bfloat16().float())
    return model, plain, handle


def test_memory_is_the_stored_values() -> None:
    model, _, _ = _pair()
    w, other = model[0].weight, model[2].weight
    assert isinstance(w, OffloadedTensor)
    assert w.data_ptr() == w.stored.data_ptr() != 0 and w.data_ptr() != other.data_ptr()
    assert w.untyped_storage().nbytes() == w.stored.untyped_storage().nbytes() == w.numel() * 2
    model.share_memory()
    assert w.is_shared() and w.stored.is_shared()


def test_values_read_out_are_those_of_the_plain_weight() -> None:
    model, plain, _ = _pair()
    w, p = model[0].weight, plain[0].weight
    assert w.detach().tolist() == p.detach().tolist()
    np.testing.assert_array_equal(w.detach().numpy(), p.detach().numpy())
    np.testing.assert_array_equal(np.asarray(w.detach()), np.asarray(p.detach()))
    assert w[1, 2].item() == p[1, 2].item()
    for t in (w, p):  # refused alike while it requires grad
        with pytest.raises(RuntimeError, match="requires grad"):
            t.numpy()


def test_views_report_the_plain_shape_stride_and_offset() -> None:
    model, plain, _ = _pair()
    for index in ((slice(1, 3), slice(1, None)), (2,), (slice(None), 3)):
        ours, theirs = model[0].weight.data[index], plain[0].weight.data[index]
        assert (ours.shape, ours.stride(), ours.storage_offset()) == (theirs.shape, theirs.stride(), theirs.storage_offset())


@pytest.mark.parametrize(
    "op", [lambda t: t.t_(), lambda t: t.transpose_(0, 1), lambda t: t.unsqueeze_(0), lambda t: t.as_strided_((2, 3), (1, 2), 1)]
)
def test_in_place_shape_changes_reshape_the_alias_only(op) -> None:  # type: ignore[no-untyped-def]
    model, plain, _ = _pair()
    ours, theirs = model[0].weight.data, plain[0].weight.data
    op(ours)
    op(theirs)
    assert (ours.shape, ours.stride(), ours.storage_offset()) == (theirs.shape, theirs.stride(), theirs.storage_offset())
    torch.testing.assert_close(ours * 1, theirs * 1, rtol=0, atol=0)
    assert model[0].weight.shape == plain[0].weight.shape == (6, 8)


def test_data_assignment_writes_the_values_rounded_as_stored() -> None:
    model, plain, handle = _pair()
    new = torch.randn(6, 8)
    model[0].weight.data = new
    plain[0].weight.data = new.bfloat16().float()
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    nn.utils.vector_to_parameters(torch.arange(106.0) / 100, model.parameters())
    nn.utils.vector_to_parameters((torch.arange(106.0) / 100).bfloat16().float(), plain.parameters())
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="convert the module"):
        model[0].weight.data = new.double()
    handle.remove()
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)  # what remove() gives back: the new values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_sees_the_plain_linear(dtype: torch.dtype) -> None:
    model, plain, _ = _pair()
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=dtype), torch.no_grad():
        ours, theirs = model(x), plain(x)
    assert ours.dtype == theirs.dtype == dtype
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_vmap_batches_the_plain_linear() -> None:
    model, plain, _ = _pair()
    x = torch.randn(5, 2, 8)
    with torch.no_grad():
        torch.testing.assert_close(torch.vmap(model)(x), torch.vmap(plain)(x))


def test_a_compiled_no_grad_forward_of_a_master_weight_reads_its_narrow_copy_as_eager_does() -> None:
    model, _, _ = _pair(master=True)
    x = torch.randn(3, 8)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
        with torch.no_grad():
            model[0].weight.mul_(1.5)  # the master changes: the narrow copy follows, compiled too
        assert torch.equal(compiled(x), model(x))


@pytest.mark.parametrize("op", [lambda t: t.t(), lambda t: t.detach(), lambda t: t[1:], lambda t: t.view(-1)])
def test_views_made_in_inference_mode_are_normal_tensors_as_the_plain_weight_s(op) -> None:  # type: ignore[no-untyped-def]
    model, plain, _ = _pair()
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = model(x)  # the narrow product: the same kernel as in inference mode, its sums in its own order
    with torch.inference_mode():
        got, want = op(model[0].weight), op(plain[0].weight)
        assert got.is_inference() == want.is_inference()
        assert torch.equal(got * 1, want * 1)
        assert torch.equal(model(x), before)
        torch.testing.assert_close(model(x), plain(x))  # the plain matmul sums in another order


# ------------------------------------------------------------------ a weight that reads as the device it computes on


@pytest.mark.accelerator
def test_a_streamed_weight_reads_as_a_tensor_on_the_device(accelerator: torch.device) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    plain = copy.deepcopy(model).to(accelerator)
    with pytest.raises(torchsurgery.BudgetError) as refused:
        torchsurgery.plan_offload(model, accelerator, groups="leaves", budget=1)
    handle = torchsurgery.offload(model, accelerator, groups="leaves", budget=refused.value.needed)  # the ring alone
    assert "0" in handle.stats().streamed_groups
    w, p = model[0].weight, plain[0].weight
    assert isinstance(w, OffloadedTensor) and w.stored.device.type == "cpu"
    assert (w.device, w.dtype, w.shape, w.stride()) == (p.device, p.dtype, p.shape, p.stride())
    with torch.no_grad():
        for op in (lambda t: t * 2, lambda t: t.t() @ torch.ones(8, device=accelerator), lambda t: t.sum(0), torch.clone):
            got, want = op(w), op(p)
            assert got.device == want.device and torch.equal(got.cpu(), want.cpu())
        assert w.to(accelerator) is w and p.to(accelerator) is p  # already there: the tensor itself
        assert torch.equal(w.cpu(), p.cpu()) and w.cpu().device.type == "cpu"
    for t in (w, p):  # values on an accelerator do not go to numpy, alike
        with pytest.raises(TypeError):
            t.detach().numpy()
    with torch.no_grad():  # an in-place write lands in the host values
        w.mul_(2)
        p.mul_(2)
    assert torch.equal(w.stored, p.cpu())
    x = torch.randn(3, 8, device=accelerator)
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
    model(x).sum().backward()  # gradients reach the weight on the device, as the plain one's
    plain(x).sum().backward()
    assert w.grad is not None and w.grad.device == p.grad.device
    assert torch.equal(w.grad, p.grad)
    handle.remove()
    assert type(model[0].weight) is nn.Parameter and model[0].weight.device.type == "cpu"
    assert torch.equal(model[0].weight, p.detach().cpu())


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_to_gives_what_it_gives_for_the_plain_weight_in_and_out_of_inference_mode(inference: bool) -> None:
    model, plain, _ = _pair()
    w, p = model[0].weight, plain[0].weight
    with torch.inference_mode(inference):
        for kwargs in ({"dtype": torch.float64}, {"device": "cpu", "dtype": torch.float16, "copy": True}, {"dtype": torch.float32}):
            got, want = w.detach().to(**kwargs), p.detach().to(**kwargs)
            assert type(got) is torch.Tensor or got is not w.detach()  # a new plain tensor, or the weight itself
            assert (got.dtype, got.device) == (want.dtype, want.device) and torch.equal(got, want)
        assert type(w.detach().to(torch.float16, copy=True)) is torch.Tensor


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_conversions_and_factories_without_a_dtype_give_the_dtype_the_weight_reads_as(inference: bool) -> None:
    # no dtype given: the result has the dtype the tensor has, which for the weight is the one
    # it reads as (fp32), not the one its values are stored in (bf16). Tensor.to passes that
    # dtype on itself; the *_like factories reach the weight without one
    model, plain, _ = _pair()
    w, p = model[0].weight, plain[0].weight
    here = torch.ones(1).device
    made = {
        "to(device)": lambda t: t.to("cpu"),
        "cpu()": lambda t: t.cpu(),
        "to(device, copy=True)": lambda t: t.to("cpu", copy=True),
        "to(other.device)": lambda t: t.to(here),
        "to(device=, non_blocking=, copy=True)": lambda t: t.to(device=here, non_blocking=True, copy=True),
        "zeros_like": torch.zeros_like,
        "ones_like": torch.ones_like,
        "full_like": lambda t: torch.full_like(t, 2.5),
        "rand_like": lambda t: torch.rand_like(t, generator=torch.Generator().manual_seed(1)),
        "randn_like": lambda t: torch.randn_like(t, generator=torch.Generator().manual_seed(1)),
        "empty_like": lambda t: torch.empty_like(t).zero_(),
    }
    with torch.inference_mode(inference):
        for name, make in made.items():
            got, want = make(w), make(p)
            assert (got.dtype, got.device, got.shape, got.requires_grad) == (
                want.dtype, want.device, want.shape, want.requires_grad
            ), name
            assert got.dtype == w.dtype == torch.float32 and torch.equal(got.detach(), want.detach()), name
