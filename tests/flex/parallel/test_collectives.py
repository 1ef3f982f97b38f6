"""The collectives hook routing uses, on three gloo ranks, against the same arithmetic in
one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _spawn import spawn

from torchsurgery.flex.parallel.collectives import (
    agree_on_failure,
    broadcast_from_root,
    gather_along,
    gather_to_root,
    piece_sizes,
)

pytestmark = pytest.mark.distributed

CPU = torch.device("cpu")
ROWS = [1, 3, 2]  # rows of each rank's piece: unequal on purpose


def _piece(rank: int) -> torch.Tensor:
    return torch.arange(ROWS[rank] * 2, dtype=torch.float32).reshape(ROWS[rank], 2) + 10 * rank


def _worker(rank: int, world: int) -> dict[str, Any]:
    group = dist.group.WORLD
    assert group is not None
    result: dict[str, Any] = {}
    local = _piece(rank)
    result["sizes"] = piece_sizes(local, 0, group, CPU)
    # differentiable: each rank's gradient is its slice of the gradient summed over ranks
    leaf = local.clone().requires_grad_()
    whole = gather_along(leaf, 0, group, result["sizes"])
    weights = torch.arange(whole.numel(), dtype=torch.float32).reshape(whole.shape) * (rank + 1)
    (whole * weights).sum().backward()
    result["whole"], result["grad"] = whole.detach(), leaf.grad
    # equal pieces along dim 1, to the first rank only
    result["to_root"] = gather_to_root(torch.full((2, 1), float(rank)), 1, group)
    result["failed"] = agree_on_failure(rank == 2, group, CPU)
    result["none_failed"] = agree_on_failure(False, group, CPU)
    # the root's result reaches every rank, whatever shape and dtype it has
    sent = torch.arange(6, dtype=torch.int64).reshape(3, 2) if rank == 0 else torch.zeros(1)
    result["broadcast"] = broadcast_from_root(sent, group, CPU)
    result["broadcast_none"] = broadcast_from_root(None, group, CPU)
    return result


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_worker, 3)


def test_piece_sizes_are_every_ranks_in_group_order(results: list[dict[str, Any]]) -> None:
    assert [r["sizes"] for r in results] == [ROWS] * 3


def test_gather_along_concatenates_unequal_pieces_and_sums_gradients_back(results: list[dict[str, Any]]) -> None:
    expected = torch.cat([_piece(r) for r in range(3)])
    numel = expected.numel()
    # the reference: one process whose loss is the sum of the three ranks' losses
    total = sum(torch.arange(numel, dtype=torch.float32).reshape(expected.shape) * (r + 1) for r in range(3))
    offsets = [0, 1, 4]
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["whole"], expected)
        torch.testing.assert_close(r["grad"], total[offsets[rank] : offsets[rank] + ROWS[rank]])


def test_gather_to_root_reaches_the_first_rank_alone(results: list[dict[str, Any]]) -> None:
    torch.testing.assert_close(results[0]["to_root"], torch.tensor([[0.0, 1.0, 2.0]] * 2))
    assert results[1]["to_root"] is None and results[2]["to_root"] is None


def test_every_rank_learns_which_ranks_failed(results: list[dict[str, Any]]) -> None:
    assert [r["failed"] for r in results] == [[2]] * 3
    assert [r["none_failed"] for r in results] == [[]] * 3


def test_broadcast_from_root_carries_shape_and_dtype(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["broadcast"].dtype == torch.int64
        assert r["broadcast"].tolist() == [[0, 1], [2, 3], [4, 5]]
        assert r["broadcast_none"] is None
