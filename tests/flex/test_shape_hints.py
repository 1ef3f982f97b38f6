"""expected_shape hints nothing needs: compared with the real shape, a mismatch told once
per hook or parameter and wrapper, never an error (flex_model ignores such hints)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

from torchsurgery import FlexModel, HookFunction, ShapeHintWarning
from torchsurgery.flex.shape_hints import HintCheck, hint_fits


def test_a_hint_fits_when_its_sizes_do_and_none_matches_any() -> None:
    assert hint_fits((2, 7), (None, 7)) and hint_fits((2, 7), (None, None)) and hint_fits((), ())
    assert not hint_fits((2, 7), (2, 8))
    assert not hint_fits((2, 7), (2,)) and not hint_fits((2, 7), (2, 7, None))  # one entry per dimension


def _told(call: object) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()  # type: ignore[operator]
    return [str(w.message) for w in caught if w.category is ShapeHintWarning]


def test_each_label_is_told_once_and_a_fitting_hint_never() -> None:
    check = HintCheck()

    def calls() -> None:
        for _ in range(3):
            check.check(torch.zeros(4, 10), (None, 20), "fc1", why="one process")
            check.check(torch.zeros(4, 12), (None, 20), "fc1", why="one process")  # other shape, same hook
            check.check(torch.zeros(4, 10), (None, 20), "fc2", why="one process")
            check.check(torch.zeros(4, 10), (None, 10), "fc3", why="one process")
            check.check(torch.zeros(4, 10), None, "fc4", why="one process")

    told = _told(calls)
    assert len(told) == 2 and "'fc1'" in told[0] and "'fc2'" in told[1]
    assert "expected_shape [None, 20] of 'fc1' does not match its shape [4, 10]" in told[0]
    assert "(one process)" in told[0] and "flex_model ignores it" in told[0]


def test_copies_remember_what_was_told() -> None:
    check = HintCheck()
    assert len(_told(lambda: check.check(torch.zeros(1), (2,), "x", why="one process"))) == 1
    for twin in (copy.deepcopy(check), pickle.loads(pickle.dumps(check))):
        assert _told(lambda t=twin: t.check(torch.zeros(1), (2,), "x", why="one process")) == []
        assert len(_told(lambda t=twin: t.check(torch.zeros(1), (2,), "y", why="one process"))) == 1


def test_a_wrapper_with_a_wrong_hint_runs_as_under_flex_model_and_says_so_once() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_forward_hook(HookFunction("0", expected_shape=(None, 8), editing_function=lambda m, x, c, mods: -x))
    flex.register_forward_hook(HookFunction("1", expected_shape=(None, 4)))  # right: never told
    x = torch.randn(2, 3)

    def forwards() -> None:
        for _ in range(3):
            flex(x)
        flex.get_module_parameter("0.weight", (4, 99))
        flex.get_module_parameter("0.weight", (4, 99))

    told = _told(forwards)
    assert len(told) == 2
    assert "expected_shape [None, 8] of '0' does not match its shape [2, 4]" in told[0]
    assert "expected_shape [4, 99] of '0.weight' does not match its shape [4, 3]" in told[1]
    plain = nn.functional.linear(x, model[0].weight, model[0].bias)
    torch.testing.assert_close(out["1"][0], torch.relu(-plain))  # the edit ran, captures were made
    assert len(out["0"]) == 3
    flex.restore()


def test_the_warning_can_be_silenced_by_category() -> None:
    flex = FlexModel(nn.Linear(2, 2), {})
    flex.register_forward_hook(HookFunction("", expected_shape=(5,)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=ShapeHintWarning)
        flex(torch.ones(1, 2))
    again = FlexModel(flex.restore(), {})
    again.register_forward_hook(HookFunction("", expected_shape=(5,)))
    with pytest.warns(ShapeHintWarning, match="of ''"):  # a new wrapper tells again
        again(torch.ones(1, 2))
    again.restore()
