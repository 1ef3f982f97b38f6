"""``torch.compile`` of a model holding offloaded weights computes what the model computes eagerly.

Every kind of offloaded weight (``_weight_kinds.KINDS``, ``DynamicSwapInstaller`` among them)
and a torchsurgery patch over one: with ``backend="aot_eager"`` (the graph run op by op) the
compiled forward equals the eager one bit for bit; with inductor it differs from eager no more
than inductor's own changes to the plain model (fused, reordered sums). Before compiling, the
weights are written once off the storage grid, so that a master copy differs from its narrow
shadow: eager forwards without gradients read the shadow, and so must compiled ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _kernel_paths import PATHS, use
from _weight_kinds import KINDS, Case, make_case
from torch import nn

import torchsurgery
from torchsurgery import FlexModel, HookFunction
from torchsurgery.compact import narrow


class _Halved(torchsurgery.Patch, nn.Linear):
    """A patched forward that reads the layer's weights through the usual call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5


SETUPS = [k.name for k in KINDS] + ["patched"]
# Groups streamed from a checkpoint file are read outside the graph, a break around each
# (docs/offload.md): no fullgraph, and their reads guard on the file's state. Known gaps,
# marked strictly so that closing one is seen.
_FROM_FILE = pytest.mark.xfail(strict=True, reason="groups streamed from a file are read outside the graph (docs/offload.md)")
COMPILED_SETUPS = [pytest.param(s, marks=_FROM_FILE) if s == "file" else s for s in SETUPS]


def _setup(name: str, tmp_path: Path) -> Case:
    """The tiny model offloaded as ``name`` says ("patched": bf16 storage, its middle layer patched after)."""
    kinds = {k.name: k for k in KINDS}
    case = make_case(kinds["bf16" if name == "patched" else name], tmp_path)
    if name == "patched":
        for model in (case.model, case.plain):
            torchsurgery.patch(model[2], _Halved)
    if not case.kind.file:  # inference only: its values stay in the file
        with torch.no_grad():
            for p in case.model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)  # off the storage grid: a master differs from its shadow
    return case


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Every case compiles from scratch, and leaves nothing compiled behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_runs(model: nn.Module, x: torch.Tensor, backend: Any, grad: bool) -> list[dict[str, torch.Tensor]]:
    """The eager forward, then three compiled calls (fullgraph, no recompile): each output, and
    the input's gradient where gradients are recorded."""
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    runs = []
    with torch.set_grad_enabled(grad), torch._dynamo.config.patch(error_on_recompile=True):
        for call in (model, compiled, compiled, compiled):
            xi = x.clone().requires_grad_(grad)
            out = call(xi)
            run = {"output": out.detach()}
            if grad:
                out.sum().backward()
                run["input gradient"] = xi.grad
            runs.append(run)
    return runs


def _max_difference(runs: list[dict[str, torch.Tensor]]) -> float:
    eager, *compiled = runs
    return max((run[k] - eager[k]).abs().max().item() for run in compiled for k in eager)


# Products without gradients by a weight stored narrower than it computes run the native kernel,
# eagerly and compiled: on every path it can take on this host (_kernel_paths), one setup per
# storage dtype. Products that record gradients, and their backward, multiply widened values.
_KERNEL_SETUPS = {"bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2"}
_BITWISE_CASES = [
    pytest.param(setup, grad, path, marks=[_FROM_FILE] if setup == "file" else [],
                 id=f"{setup}-{'grad' if grad else 'no_grad'}-{path}")
    for setup in SETUPS
    for grad in (False, True)
    for path in (PATHS if not grad and setup in _KERNEL_SETUPS else ["native"])
]


@pytest.mark.parametrize(("setup", "grad", "path"), _BITWISE_CASES)
def test_aot_eager_compiled_forward_is_the_eager_forward_bit_for_bit(
    setup: str, grad: bool, path: str, tmp_path: Path, fresh_dynamo: None
) -> None:
    """The same operators on the same values: equal outputs (and, recording gradients, equal input gradients)."""
    case = _setup(setup, tmp_path)
    if grad and case.kind.file:
        pytest.skip("weights streamed from a file are inference only")
    with use(path):
        eager, *compiled = _compiled_runs(case.model, torch.randn(3, 8), "aot_eager", grad)
    for i, run in enumerate(compiled):
        for what, value in run.items():
            assert torch.equal(value, eager[what]), (
                f"compiled call {i}: its {what} differs from eager's by up to {(value - eager[what]).abs().max().item():.3g}"
            )


def test_a_compiled_backward_multiplies_by_the_widened_weight_as_eager_s_does(
    tmp_path: Path, fresh_dynamo: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eager backward multiplies the output gradient by the widened copy its forward saved, with
    the CPU's matmul; the compiled backward must too, not take the narrow kernel, whose sums run
    in another order (one ulp apart from the matmul's on some hosts, equal on others: counted
    here, so that the difference shows on every host)."""
    case = _setup("bf16", tmp_path)
    calls: list[int] = []
    kernel = narrow.narrow_matvec
    monkeypatch.setattr(narrow, "narrow_matvec", lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs))
    eager, *compiled = _compiled_runs(case.model, torch.randn(3, 8), "aot_eager", grad=True)
    assert calls == []
    with torch.no_grad():  # and without gradients both take the kernel
        case.model(torch.randn(3, 8))
    assert calls == [1] * 3


@pytest.mark.slow  # inductor compiles take a while on a small machine
@pytest.mark.parametrize("setup", ["bf16", "master"])
def test_inductor_compiled_forward_differs_from_eager_no_more_than_on_the_plain_model(
    setup: str, tmp_path: Path, fresh_dynamo: None
) -> None:
    """|compiled - eager| of the offloaded model within 4x that of the plain model (plus 1e-6)."""
    case = _setup(setup, tmp_path)
    x = torch.randn(3, 8)
    differences = {}
    for name, model in (("plain", case.plain), ("offloaded", case.model)):
        torch._dynamo.reset()
        differences[name] = _max_difference(_compiled_runs(model, x, "inductor", grad=False))
    assert differences["offloaded"] <= 4 * differences["plain"] + 1e-6, differences


@pytest.mark.parametrize("setup", COMPILED_SETUPS)
def test_a_compiled_flex_model_over_an_offloaded_model_compiles_once_and_equals_eager(
    setup: str, tmp_path: Path, fresh_dynamo: None
) -> None:
    """``torch.compile(FlexModel(model))`` with an editing hook: the outputs and captures of eager, as
    many compiled frames as over the plain model, the offload's group forward aside (the hooks run outside the
    graph), none recompiled."""
    from torch._dynamo.testing import CompileCounterWithBackend

    case = _setup(setup, tmp_path)
    x = torch.randn(3, 8)
    frames = {}
    results = {}
    for name, model in (("plain", case.plain), ("offloaded", case.model)):
        torch._dynamo.reset()
        out: dict[str, list[torch.Tensor]] = {}
        flex = FlexModel(model, out)
        flex.register_forward_hook(HookFunction("2", editing_function=lambda m, t, ctx, mods: t * 2))
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(flex, backend=counter)
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
            eager = flex(x)
            runs = [compiled(x) for _ in range(3)]
        frames[name] = counter.frame_count
        results[name] = (eager, runs, out["2"])
        flex.restore()
    eager, runs, captures = results["offloaded"]
    # the offload's own group forward may be a frame of its own; none is compiled twice
    assert frames["offloaded"] <= frames["plain"] + 1, frames
    assert len(captures) == 4
    for i, run in enumerate(runs):
        assert torch.equal(run, eager), f"compiled call {i}: max |compiled - eager| = {(run - eager).abs().max().item():.3g}"
        assert torch.equal(captures[i + 1], captures[0]), f"compiled call {i}: its capture differs from eager's"
