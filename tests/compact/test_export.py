"""``torch.export.export`` of an offloaded model gives the plain model's program.

The reference is the plain model holding the values the offloaded one computes with (rounded
to the storage dtype; a scaled format's dequantised values): the exported program computes
in the compute dtype as that model does, on the CPU, with groups streamed through the host,
and with groups streamed to an accelerator (the program then copies the stored weights in at
every call, as a compiled forward does). A model whose groups stream from a checkpoint file
is refused, before anything changes, with the way out.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from _weight_kinds import KINDS, SCALED_KINDS, Case, dequantised, make_case
from torch import nn

import torchsurgery
from torchsurgery.compact import Scaled

_KINDS = {k.name: k for k in KINDS + SCALED_KINDS}


def _export(model: nn.Module, x: torch.Tensor) -> torch.export.ExportedProgram:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's own deprecations while it traces
        return torch.export.export(model, (x,))


@pytest.mark.parametrize(
    "name", ["bf16", "fp8_e4m3fn", "master", "streamed", "float8_e4m3fn-channel", "float8_e5m2-tensor", "int8-channel"]
)
def test_the_exported_program_computes_as_the_plain_model(name: str, tmp_path: Path) -> None:
    """bf16, fp8 and scaled storage, a master copy, groups streamed through the host: the program's outputs are the plain model's."""
    case: Case = make_case(_KINDS[name], tmp_path)
    x = torch.randn(3, 8)
    program = _export(case.model, x).module()
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            got, expected = program(x), case.plain(x)
        assert got.dtype == expected.dtype == torch.float32
        torch.testing.assert_close(got, expected, msg=lambda m, g=grad: f"the exported program (grad={g}): {m}")
    torch.testing.assert_close(case.model(x), case.plain(x))  # the model itself is as it was


def _streamed(storage: torch.dtype | Scaled | None, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """A model whose every group streams to ``device`` (the least budget), and the plain model with its values there."""
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    options = {"storage_dtype": storage, "dtype": torch.float32, "device": device, "groups": "leaves"}
    try:
        torchsurgery.plan_offload(model, budget=1, **options)
    except torchsurgery.BudgetError as refused:
        needed = refused.needed
    plain = copy.deepcopy(model)
    handle = torchsurgery.offload(model, budget=needed, **options)
    assert not any(g.resident for g in handle.plan.groups), handle.plan
    with torch.no_grad():
        for p, q in zip(plain.parameters(), model.parameters(), strict=True):
            p.copy_(dequantised(q))
    return model, plain.to(device)


@pytest.mark.accelerator
@pytest.mark.parametrize("storage", [torch.bfloat16, Scaled(torch.float8_e4m3fn)], ids=["bf16", "fp8-scaled"])
def test_groups_streamed_to_the_accelerator_export(storage: torch.dtype | Scaled, accelerator: torch.device) -> None:
    model, plain = _streamed(storage, accelerator)
    x = torch.randn(3, 32, device=accelerator)
    program = _export(model, x).module()
    with torch.no_grad():
        torch.testing.assert_close(program(x), plain(x))
        torch.testing.assert_close(model(x), plain(x))  # the offload streams on as before


def test_a_model_streamed_from_a_checkpoint_file_is_refused_as_it_was(tmp_path: Path) -> None:
    case = make_case(_KINDS["file"], tmp_path)
    x = torch.randn(3, 8)
    with torch.no_grad(), pytest.raises(RuntimeError, match="torch.export cannot export .* streams from a checkpoint file") as refused:
        _export(case.model, x)
    assert "Load the weights into memory first" in str(refused.value)
    with torch.no_grad():
        torch.testing.assert_close(case.model(x), case.plain(x))
    case.undo()
