"""Editing functions across the ranks of a stage (two data-parallel replicas on gloo): the
global batch, the replica's rows, one rank's result for all, and failures agreed on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _faults import outcome
from _spawn import spawn

from torchsurgery.flex import Binding, HookFunction, HookType
from torchsurgery.flex.parallel import make_layout
from torchsurgery.flex.parallel.edits import StageEdits, replica_scale

pytestmark = pytest.mark.distributed

ROWS = [1, 3]


def _batch() -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32).reshape(4, 2) ** 2


def _rows(rank: int) -> torch.Tensor:
    return _batch().split(ROWS)[rank]


def _center(t: torch.Tensor) -> torch.Tensor:
    return t - t.mean(0, keepdim=True)


def _binding(hook_type: HookType = "forward", **options: Any) -> Binding:
    return Binding(HookFunction("act", editing_function=lambda m, t, c, mods: t, **options), hook_type, "act", "act")


def _worker(rank: int, world: int) -> dict[str, Any]:
    layout = make_layout(data_parallel_size=world)
    edits = StageEdits(layout)
    result: dict[str, Any] = {"scales": [replica_scale(layout, k) for k in ("forward", "full_backward", "tensor")]}
    result["global"] = edits.run(_binding(), _rows(rank), _center)
    result["local"] = edits.run(_binding(edit_batch="local"), _rows(rank), _center)
    seen: list[torch.Tensor] = []

    def noisy(t: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(100 + rank)  # each rank would draw other numbers
        seen.append(t + torch.randn_like(t))
        return seen[-1]

    result["rank0"] = edits.run(_binding(edit_on="rank0"), _rows(rank), noisy)
    result["rank0_computed"] = seen  # only rank 0 ran the edit
    looked: list[torch.Tensor] = []

    def look(t: torch.Tensor) -> torch.Tensor:
        looked.append(t.clone())
        return t * 3

    # a parameter's gradient: every replica edits the replicas' mean
    result["param_grad"] = edits.run(_binding("tensor"), torch.full((2,), float(rank + 1)), look)
    # an activation gradient: the edit sees the gradient of the mean loss, and the result is scaled back
    result["act_grad"] = edits.run(_binding("full_backward"), _rows(rank), look)
    result["looked"] = looked

    def fail_on_one(t: torch.Tensor) -> torch.Tensor:
        if rank == 1:
            raise ValueError("boom on purpose")
        return t

    call: Callable[[], Any] = lambda: edits.run(_binding(), _rows(rank), fail_on_one)  # noqa: E731
    result["failure"] = outcome(call)
    result["after_failure"] = edits.run(_binding(), _rows(rank), _center)  # the ranks stay in step
    return result


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_worker, 2)


def test_replica_scale_is_the_data_parallel_size_for_activation_gradients_only(results: list[dict[str, Any]]) -> None:
    assert results[0]["scales"] == [1, 2, 1]


def test_a_global_edit_sees_the_whole_batch_and_each_rank_keeps_its_rows(results: list[dict[str, Any]]) -> None:
    expected = _center(_batch()).split(ROWS)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["global"], expected[rank])
        torch.testing.assert_close(r["after_failure"], expected[rank])


def test_a_local_edit_sees_the_replicas_rows_alone(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["local"], _center(_rows(rank)))


def test_an_edit_on_rank0_is_computed_once_and_shared(results: list[dict[str, Any]]) -> None:
    (computed,) = results[0]["rank0_computed"]
    assert results[1]["rank0_computed"] == []
    torch.testing.assert_close(torch.cat([r["rank0"] for r in results]), computed)


def test_gradient_edits_see_one_process_gradient(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        mean_grad, act_grad = r["looked"]
        torch.testing.assert_close(mean_grad, torch.full((2,), 1.5))  # the replicas' mean
        torch.testing.assert_close(r["param_grad"], torch.full((2,), 4.5))
        torch.testing.assert_close(act_grad, _batch() / 2)  # the gradient of the mean of 2 losses
        torch.testing.assert_close(r["act_grad"], _rows(rank) * 3)


def test_a_failing_edit_stops_every_rank_naming_the_failed_one(results: list[dict[str, Any]]) -> None:
    assert results[0]["failure"].startswith("RuntimeError: torchsurgery.FlexModel: the editing function")
    assert "'act' raised on rank(s) [1]" in results[0]["failure"]
    assert results[1]["failure"].startswith("ValueError: boom on purpose")
    assert "raised on rank(s) [1]" in results[1]["failure"]  # the note on the original error
