"""Errors carry their facts as fields, render from them, survive pickling, and stay ValueError/TypeError."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import torchsurgery
from torchsurgery.errors import (
    ArgumentError,
    ArgumentTypeError,
    ArgumentValueError,
    BudgetError,
    NoMatchError,
    Setting,
)

ERRORS = [
    NoMatchError("torchsurgery.patch", "layer.0", ["layers.0", "layers.1"], "submodule", "or use a filter"),
    NoMatchError("torchsurgery.offload", "blk", [], arg="groups"),
    ArgumentValueError("f", "device", "xpu", "'xpu' is not available", "use {} or an accelerator", Setting("device", "cpu")),
    ArgumentTypeError("f", "dtype", "bf16", "must be a torch.dtype, got 'bf16'"),
    BudgetError("torchsurgery.offload", 1000, 4096, "layers.0"),
    BudgetError("torchsurgery.offload", 10, 20, "", finer=False),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_pickling_keeps_type_fields_message_and_notes(error: Exception) -> None:
    error.add_note("raised on rank 1")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert vars(copy) == vars(error) and copy.__notes__ == ["raised on rank 1"]
    del error.__notes__


def test_each_error_is_the_builtin_exception_raised_before() -> None:
    assert issubclass(NoMatchError, ValueError)
    assert issubclass(ArgumentValueError, ValueError) and issubclass(ArgumentValueError, ArgumentError)
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, ArgumentError)
    assert issubclass(BudgetError, ArgumentValueError)
    assert not issubclass(ArgumentTypeError, ValueError) and not issubclass(ArgumentValueError, TypeError)


def test_no_match_renders_with_another_prefix_from_its_fields() -> None:
    error = NoMatchError("torchsurgery.offload", "blk", ["block"], advice="or use blocks", arg="groups")
    assert str(error) == (
        "torchsurgery.offload (groups): 'blk' matches no submodule of the model; did you mean 'block'?; or use blocks"
    )
    assert error.render("--groups") == "--groups: 'blk' matches no submodule of the model; did you mean 'block'?; or use blocks"
    assert (error.wanted, error.near, error.kind) == ("blk", ("block",), "submodule")


def test_argument_error_writes_its_suggested_setting_in_the_callers_terms() -> None:
    error = ArgumentValueError("f", "device", "xpu", "'xpu' is not available", "use {} or an accelerator",
                               Setting("device", "cpu"))
    assert str(error) == "f: device 'xpu' is not available; use device='cpu' or an accelerator"
    assert error.fix_in(lambda s: f"--{s.arg} {s.value}") == "use --device cpu or an accelerator"
    plain = ArgumentTypeError("f", "dtype", 3, "must be a torch.dtype, got 3")
    assert str(plain) == "f: dtype must be a torch.dtype, got 3" and plain.fix_in() == ""


def test_budget_error_fields_and_fix() -> None:
    error = BudgetError("torchsurgery.offload", 1000, 4096, "layers.0")
    assert (error.arg, error.value, error.budget, error.needed, error.group) == ("budget", 1000, 1000, 4096, "layers.0")
    assert error.setting == Setting("groups", "leaves")
    assert str(error) == (
        "torchsurgery.offload: budget=1000 bytes cannot hold the largest group 'layers.0' (4096 bytes); "
        "give at least that, or smaller groups (groups='leaves')"
    )
    leaves = BudgetError("torchsurgery.offload", 10, 20, "", finer=False)
    assert leaves.setting is None and str(leaves).endswith("group '<root>' (20 bytes); give at least that")


def _blocks() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)) for _ in range(3)])


def test_offload_refusals_carry_fields_and_leave_the_model_alone() -> None:
    model = _blocks()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    block = sum(p.numel() * p.element_size() for p in model[0].parameters())
    with pytest.raises(BudgetError) as budget:
        torchsurgery.offload(model, budget=100)
    assert (budget.value.budget, budget.value.needed, budget.value.group, budget.value.finer) == (100, block, "0", True)
    with pytest.raises(BudgetError) as leaves:
        torchsurgery.offload(model, budget=100, groups="leaves")
    assert leaves.value.finer is False and leaves.value.needed == 8 * 8 * 4 + 8 * 4
    with pytest.raises(ArgumentValueError) as overlap:
        torchsurgery.offload(model, groups=["0", "0.1"])
    assert (overlap.value.arg, overlap.value.value, overlap.value.problem) == ("groups", ["0", "0.1"], "'0' and '0.1' overlap")
    with pytest.raises(NoMatchError) as missing:
        torchsurgery.offload(model, groups=["9"])
    assert (missing.value.arg, missing.value.wanted) == ("groups", "9")
    with pytest.raises(ArgumentTypeError) as dtype:
        torchsurgery.offload(model, dtype="bf16")  # type: ignore[arg-type]
    assert (dtype.value.arg, dtype.value.value) == ("dtype", "bf16")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torchsurgery.surgery_log(model) == []
