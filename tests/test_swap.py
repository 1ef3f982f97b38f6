"""What the pillars that keep a tensor's identity check before swapping data into it."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils import swap_tensors

from torchsurgery._swap import swap_blocker, swap_in, wrap_like


class Tagged(nn.Parameter):
    """A Parameter subclass carrying an attribute, as quantisation libraries use them."""


def test_wrap_like_keeps_the_kind_of_tensor_and_its_grad_flag() -> None:
    plain = nn.Parameter(torch.ones(2), requires_grad=False)
    new = wrap_like(plain, torch.zeros(2, dtype=torch.float64))
    assert type(new) is nn.Parameter and not new.requires_grad and new.dtype == torch.float64

    tagged = Tagged(torch.ones(2))
    tagged.scale = 3.0
    new = wrap_like(tagged, torch.zeros(2))
    assert type(new) is Tagged and new.scale == 3.0 and new.requires_grad

    buffer = torch.ones(2)
    assert type(wrap_like(buffer, torch.zeros(2))) is torch.Tensor


def test_a_swap_the_blocker_allows_succeeds_in_place() -> None:
    layer = nn.Linear(2, 2)
    weight = layer.weight
    replacement = wrap_like(weight, weight.detach().double())
    assert swap_blocker("weight", weight, replacement, "example") is None
    swap_tensors(weight, replacement)
    assert layer.weight is weight and weight.dtype == torch.float64 and isinstance(weight, nn.Parameter)


def test_weak_references_and_pending_backwards_block_a_swap_as_torch_would() -> None:
    layer = nn.Linear(2, 2)
    ref = weakref.ref(layer.weight)
    reason = swap_blocker("weight", layer.weight, None, "example")
    assert reason is not None and "weak references" in reason
    with pytest.raises(RuntimeError):  # torch refuses it too
        swap_tensors(layer.weight, nn.Parameter(torch.zeros(2, 2)))
    del ref

    loss = layer(torch.ones(1, 2)).sum()  # the graph holds the weight until backward runs
    reason = swap_blocker("weight", layer.weight, None, "example")
    assert reason is not None and "backward has not run" in reason
    loss.backward()
    del loss
    assert swap_blocker("weight", layer.weight, None, "example") is None


def test_an_undo_swaps_a_weight_a_live_graph_saved_and_that_backward_raises() -> None:
    # x * gain saves gain itself in the graph: swap_tensors refuses it (use count 3), an undo may not
    gain = nn.Parameter(torch.full((2,), 3.0))
    out = (torch.ones(2, requires_grad=True) * gain).sum()
    with pytest.raises(RuntimeError, match="use_count"):
        swap_tensors(gain, nn.Parameter(torch.zeros(2)))
    swap_in(gain, wrap_like(gain, torch.full((2,), 5.0, dtype=torch.float64)), pending_backward_ok=True)
    assert type(gain) is nn.Parameter and gain.dtype == torch.float64 and torch.equal(gain, torch.full((2,), 5.0).double())
    with pytest.raises(RuntimeError, match="recorded before an undo"):
        out.backward()  # its gradient has no parameter to go to
    (gain * 2).sum().backward()  # the object's new content trains as a plain parameter's
    assert torch.equal(gain.grad, torch.full((2,), 2.0, dtype=torch.float64))


def test_a_hold_mark_stays_on_the_object_through_a_swap() -> None:
    from torchsurgery import _undo

    layer = nn.Linear(2, 2)
    held = _undo.hold([layer.weight], "an example")
    swap_in(layer.weight, wrap_like(layer.weight, layer.weight.detach().double()))
    assert _undo.holder_of_any([layer.weight]) == "an example"
    _undo.release(held)
    assert _undo.holder_of_any([layer.weight]) is None


class Slotted(nn.Parameter):
    """A Parameter subclass keeping its state in ``__slots__``."""

    __slots__ = ("tag", "spare")


def _slotted(tag: str, value: float) -> Slotted:
    t = Slotted(torch.full((2,), value))
    t.tag = tag
    return t


@pytest.mark.parametrize("held_weakly", [False, True])
def test_swap_in_swaps_slots_as_swap_tensors_does(held_weakly: bool) -> None:
    # the reference: torch's own swap of two objects nothing refers to weakly
    ref_a, ref_b = _slotted("a", 1.0), _slotted("b", 2.0)
    ref_b.spare = "only b"
    swap_tensors(ref_a, ref_b)
    a, b = _slotted("a", 1.0), _slotted("b", 2.0)
    b.spare = "only b"
    ref = weakref.ref(a) if held_weakly else None  # swap_tensors refuses this one; swap_in does not
    swap_in(a, b)
    for got, want in ((a, ref_a), (b, ref_b)):
        assert got.tag == want.tag and getattr(got, "spare", None) == getattr(want, "spare", None)
        assert torch.equal(got, want)
    assert ref is None or ref() is a
