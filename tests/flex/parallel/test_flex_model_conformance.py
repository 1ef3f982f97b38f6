"""flex_model 0.1.0's own tests and examples, from the installed wheel, at 1, 2 and 4 gloo
ranks: against flex_model itself (what it does on these CPUs) and against torchsurgery.

How they run (the import shim, the CPU adaptations, the stand-in models) is in
``_flex_model_wheel.py``. Each library and world size is one spawned world that runs every
item that fits it in turn, as flex_model's own multi-GPU launcher runs a batch of tests.
flex_model's own runs are the reference column of docs/flex.md's table, facts about a
pinned wheel: they are marked ``slow`` (``make slow``), which keeps half of this
module's time out of ``make test``. docs/flex.md keeps the table of what runs, at which
sizes, and why the rest does not run against torchsurgery;
``test_the_docs_table_is_this_suite`` holds it to that.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from _flex_model_wheel import (
    ITEMS,
    LIBRARIES,
    NOT_RUNNABLE,
    SITE,
    items,
    llama_2_7b,
    llama_2_13b,
    run_items,
    tokenizer,
)
from _spawn import spawn
from torch import nn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(SITE is None or not (SITE / "_test").is_dir(), reason="the flex-model 0.1.0 wheel is not installed"),
]

WORLDS = (1, 2, 4)
DOCS = Path(__file__).resolve().parents[3] / "docs" / "flex.md"
_RUNS: dict[tuple[str, int], list[dict[str, dict[str, Any]]] | AssertionError] = {}


def _world(library: str, world: int) -> list[dict[str, dict[str, Any]]]:
    """Every rank's results of ``library``'s items on ``world`` ranks (run once, on first use)."""
    if (library, world) not in _RUNS:
        plan = [(library, item.id) for item in items(library, world)]
        try:
            _RUNS[library, world] = [rank[library] for rank in spawn(run_items, world, plan)]
        except AssertionError as exc:  # a rank died: every item of the world reports it, none re-runs it
            _RUNS[library, world] = exc
    runs = _RUNS[library, world]
    if isinstance(runs, AssertionError):
        raise runs
    return runs


def _marked(library: str, world: int) -> tuple[pytest.MarkDecorator, ...]:
    # every item that runs at 4 ranks runs at 2 too: the 4-rank world is left to `make slow`
    return (pytest.mark.slow,) if library == "flex_model" or world == 4 else ()


CASES = [
    pytest.param(library, world, item.id, marks=_marked(library, world), id=f"{library}-{world}rank-{item.id}")
    for world in WORLDS
    for library in LIBRARIES
    for item in items(library, world)
]


@pytest.mark.parametrize(("library", "world", "item"), CASES)
def test_wheel_item_passes(library: str, world: int, item: str) -> None:
    outcomes = [rank[item]["outcome"] for rank in _world(library, world)]
    assert outcomes == ["passed"] * world


def test_every_shipped_test_and_example_is_accounted_for() -> None:
    assert SITE is not None
    shipped = {
        f"{path.relative_to(SITE)}::{node.name}"
        for path in sorted((SITE / "_test").rglob("test_*.py"))
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }
    shipped |= {str(path.relative_to(SITE)) for path in (SITE / "examples").glob("*_example.py")}
    assert shipped == {item.id for item in ITEMS} | set(NOT_RUNNABLE)
    public = [item for item in ITEMS if not item.private]
    assert (len(ITEMS), len(public)) == (45, 19)  # the counts docs/flex.md quotes


def _plain_hook(model: nn.Module, module: str, input_ids: torch.Tensor) -> torch.Tensor:
    """What a plain forward hook on ``module`` takes from ``model`` run on ``input_ids``."""
    seen: list[torch.Tensor] = []
    model.get_submodule(module).register_forward_hook(lambda m, a, out: seen.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        model(input_ids)
    return seen[0]


_WORLD_CASES = [
    pytest.param(library, world, marks=_marked(library, world), id=f"{library}-{world}rank")
    for library in LIBRARIES
    for world in WORLDS
]


@functools.cache
def _fsdp_example_reference() -> torch.Tensor:
    # fsdp_example: rank 0 prints the MLP output of layer 30 of the 13b stand-in for four
    # prompts padded with EOS to 512 tokens, whatever the number of ranks sharing them
    prompts = ["It's a nice day we're having", "The capital of Canada is",
               "What should I eat for dinner tonight?", "There's about three people going to"]
    padded = tokenizer()
    padded.pad_token = padded.eos_token
    input_ids = padded(prompts, padding="max_length", max_length=512, return_tensors="pt")["input_ids"]
    seen = _plain_hook(llama_2_13b(), "model.layers.30.mlp", input_ids)
    assert seen.shape == (4, 512, 5120) and seen.dtype == torch.bfloat16
    return seen


@pytest.mark.parametrize(("library", "world"), _WORLD_CASES)
def test_examples_capture_what_a_plain_torch_hook_sees(library: str, world: int) -> None:
    if world == 1:  # single_gpu_example prints the captures of layer 24 of the 7b stand-in
        (activations,) = _world(library, 1)[0]["examples/single_gpu_example.py"]["printed"]
        assert list(activations) == ["model.layers.24"]
        input_ids = tokenizer()("Where is the best spot for lunch?", return_tensors="pt")["input_ids"]
        seen = _plain_hook(llama_2_7b(), "model.layers.24", input_ids)
        torch.testing.assert_close(activations["model.layers.24"][0], seen, rtol=0, atol=0)
    shape, activation = _world(library, world)[0]["examples/fsdp_example.py"]["printed"]
    assert shape == "Activation shape: torch.Size([4, 512, 5120])"
    torch.testing.assert_close(activation, _fsdp_example_reference(), rtol=0, atol=0)


@pytest.mark.parametrize("world", [pytest.param(world, marks=_marked("torchsurgery", world)) for world in WORLDS])
def test_a_wrong_hint_that_flex_model_ignores_is_told_once(world: int) -> None:
    # its fairscale full_backward tests hint (None, None, 20) for column_parallel_linear's
    # input gradient, 10 wide; in the DDP run (tensor_parallel_size 1) nothing needs the hint
    told = {
        "_test/multi_gpu/core/test_fairscale_mpu_vs_ddp.py::test_full_backward_hooks_fairscale",
        "_test/multi_gpu/core/test_fairscale_mpu_vs_ddp.py::test_full_backward_pre_hooks_fairscale",
    }
    for rank in _world("torchsurgery", world):
        for item, result in rank.items():
            if item not in told:
                assert result["hints"] == [], item
                continue
            (message,) = result["hints"]
            assert "[None, None, 20] of 'module.column_parallel_linear'" in message
            assert f"its shape [{4 // world}, 42, 10]" in message and "tensor_parallel_size is 1" in message


def _table() -> list[list[str]]:
    """The rows of docs/flex.md's table of flex_model's suite, as cells."""
    text = DOCS.read_text()
    section = text[text.index("## Conformance with flex_model's own suite") :]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_the_docs_table_is_this_suite() -> None:
    listed: dict[str, list[str]] = {}
    for cells in _table():
        test, ranks, theirs, ours, why = cells
        path = re.match(r"`([^`]+\.py)`", test)
        assert path is not None, test
        names = re.findall(r"`(test_\w+)`", test)
        for item in [f"{path.group(1)}::{name}" for name in names] or [path.group(1)]:
            assert item not in listed, item
            listed[item] = [ranks, theirs, ours, why]
    by_id = {item.id: item for item in ITEMS}
    assert set(listed) == set(by_id) | set(NOT_RUNNABLE)
    for item_id, (ranks, theirs, ours, why) in listed.items():
        if item_id in NOT_RUNNABLE:
            assert (ranks, theirs, ours, why) == ("–", "not run", "not run", NOT_RUNNABLE[item_id]), item_id
            continue
        item = by_id[item_id]
        assert ranks == ", ".join(map(str, item.worlds)), item_id
        assert theirs == "passes", item_id
        assert (ours, why) == (("not run", item.private) if item.private else ("passes", "")), item_id
